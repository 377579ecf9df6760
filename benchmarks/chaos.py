"""Chaos probes against a live ``hotpool serve``: the ways one request or one outage could
hurt every tenant (issue 46), each run and judged held or failed, with its numbers.

    .venv/bin/python benchmarks/chaos.py [--postgres URL] [--cache DIR]

It starts its own server (API keys required; SmolLM2 bf16; the ledger on a fresh PostgreSQL
database reached through a TCP proxy this script holds, so that it can stop the database
and freeze it) and runs, in order:

1. ``schema storm``: /healthz and a 24-token stream, idle and then beside four clients each
   looping new ~190 KB JSON Schemas (wrong only at their end) and one 3 MB schema. Held:
   /healthz's median, the stream's first token and its 90th-percentile gap within 100 ms of
   idle, and no 5xx.
2. ``bodies in one read``: a 71 KB chat request and a 1 MB one, each head and body in one
   write. Held: 200 and 400 (context) as their contents deserve, never 431.
3. ``database stopped`` / ``database frozen``: 3 clients streaming requests with a key
   checked before, while the database refuses connections (or answers nothing) for 4 s,
   and a key never checked asked mid-outage. Held: every request with the known key 200
   within 5 s, the unknown key a 503 with Retry-After, and every request billed after.
4. ``prompt past the context``: a 7.8 MB prompt while 6 normal requests go. Held: they are
   all 200, the big one a 400 ``context_length_exceeded``.
5. ``kill -9 at the first token``: the control plane killed as a 1,500-word prompt's first
   chunk arrives, then restarted. Held: the ledger bills the whole prompt and >= 1 token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from scratch_postgres import fresh_database
from serve_process import pct, serve, smollm2_snapshot, wait_for
from sqlalchemy import make_url
from tcp_proxy import TcpProxy

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore, parse_scopes
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import DEFAULT_TENANT_ID

CHAT = "/v1/chat/completions"
MODEL = "chaos"


@dataclass
class Result:
    probe: str
    held: bool
    numbers: str


class Chaos:
    def __init__(self, url: str, key: str, unseen: str) -> None:
        self.url, self.key, self.unseen = url, key, unseen

    def chat(self, content: str, key: str | None = None, **extra: object) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
        headers = {"authorization": f"Bearer {key or self.key}"}
        return httpx.post(self.url + CHAT, json=body, headers=headers, timeout=300)

    def healthz(self, probes: int = 20) -> list[float]:
        times = []
        for _ in range(probes):
            t0 = time.perf_counter()
            httpx.get(f"{self.url}/healthz", timeout=120)
            times.append(time.perf_counter() - t0)
            time.sleep(0.02)
        return times

    def stream_waits(self) -> list[float]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to fifty."}],
                "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        waits, last = [], time.perf_counter()
        headers = {"authorization": f"Bearer {self.key}"}
        with httpx.stream("POST", self.url + CHAT, json=body, headers=headers, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    waits.append(now - last)
                    last = now
        return waits


def _looping(
    n: int, work: Callable[[int, int], None]
) -> tuple[threading.Event, list[threading.Thread]]:
    stop = threading.Event()

    def loop(client: int) -> None:
        i = 0
        while not stop.is_set():
            work(client, i)
            i += 1

    threads = [threading.Thread(target=loop, args=(c,)) for c in range(n)]
    for t in threads:
        t.start()
    return stop, threads


def schema_storm(c: Chaos) -> Result:
    c.stream_waits()
    idle_h, idle_s = c.healthz(), c.stream_waits()
    statuses: list[int] = []

    def schema_request(tag: str, properties: int) -> None:
        props: dict[str, object] = {f"{tag}{i}": {"type": "integer"} for i in range(properties)}
        props["last"] = {"type": "strin"}
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": props}}}  # fmt: skip
        statuses.append(c.chat("JSON", max_tokens=1, response_format=fmt).status_code)

    stop, threads = _looping(4, lambda client, i: schema_request(f"c{client}n{i}p", 5500))
    huge = threading.Thread(target=schema_request, args=("h", 90_000))
    huge.start()
    try:
        time.sleep(0.5)
        busy_h, busy_s = c.healthz(), c.stream_waits()
    finally:
        stop.set()
        for t in [huge, *threads]:
            t.join()
    d_h = pct(busy_h, 0.5) - pct(idle_h, 0.5)
    d_first = busy_s[0] - idle_s[0]
    d_gap = pct(busy_s[1:], 0.9) - pct(idle_s[1:], 0.9)
    server_errors = sum(s >= 500 for s in statuses)
    held = max(d_h, d_first, d_gap) < 0.1 and not server_errors
    return Result(
        "schema storm", held,
        f"/healthz p50 {pct(idle_h, 0.5) * 1e3:.1f} -> {pct(busy_h, 0.5) * 1e3:.1f} ms; stream "
        f"first {idle_s[0] * 1e3:.0f} -> {busy_s[0] * 1e3:.0f} ms, gap p90 "
        f"{pct(idle_s[1:], 0.9) * 1e3:.0f} -> {pct(busy_s[1:], 0.9) * 1e3:.0f} ms; "
        f"{len(statuses)} schema requests, {server_errors} 5xx",
    )  # fmt: skip


def bodies_in_one_read(c: Chaos) -> Result:
    host, port = c.url.removeprefix("http://").split(":")
    got = []
    for words, want in ((3400, 200), (60_000, 400)):
        body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": "internationalization " * words}]}).encode()  # fmt: skip
        head = (f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"authorization: Bearer {c.key}\r\nconnection: close\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        with socket.create_connection((host, int(port)), timeout=120) as s:
            s.sendall(head + body)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        got.append((len(body), int(answer.split(b" ", 2)[1]), want))
    held = all(status == want for _, status, want in got)
    return Result(
        "bodies in one read", held,
        ", ".join(f"{n / 1024:.0f} KB -> {status}" for n, status, _ in got),
    )  # fmt: skip


def database_outage(c: Chaos, proxy: TcpProxy, kind: str, ledger_url: str) -> Result:
    c.chat("Warm up.", max_tokens=1)
    sent: list[tuple[str, int, float]] = []

    def one(_: int, __: int) -> None:
        t0 = time.monotonic()
        r = c.chat("One, two,", max_tokens=2)
        sent.append((r.headers.get("x-request-id", ""), r.status_code, time.monotonic() - t0))

    stop, threads = _looping(3, one)
    try:
        time.sleep(1)
        if kind == "stopped":
            proxy.cut()
        else:
            proxy.freeze()
        time.sleep(3)  # past the key cache: every check now needs the database
        t0 = time.monotonic()
        other = c.chat("hi", key=c.unseen, max_tokens=1)
        other_s = time.monotonic() - t0
        time.sleep(1)
    finally:
        proxy.restore()
        proxy.thaw()
        time.sleep(2)
        stop.set()
        for t in threads:
            t.join()
    ids = {rid for rid, status, _ in sent if status == 200}

    def billed() -> bool:
        db = Database(ledger_url)
        try:
            return ids <= {r.request_id for r in Ledger(db).events(limit=1_000_000)}
        finally:
            db.dispose()

    try:
        wait_for("every request to be billed", billed, 60, 0.5)
        unbilled = 0
    except TimeoutError:
        unbilled = len(ids)
    statuses = [s for _, s, _ in sent]
    slowest = max(took for _, _, took in sent)
    held = (set(statuses) == {200} and slowest < 5 and other.status_code == 503
            and "retry-after" in other.headers and not unbilled)  # fmt: skip
    return Result(
        f"database {kind}", held,
        f"{len(statuses)} requests: {statuses.count(200)} 200, "
        f"{sum(s >= 500 for s in statuses)} 5xx, slowest {slowest:.2f} s; a key never "
        f"checked: {other.status_code} in {other_s:.2f} s; unbilled {unbilled}",
    )  # fmt: skip


def prompt_past_the_context(c: Chaos) -> Result:
    big: list[httpx.Response] = []
    t0 = time.monotonic()
    thread = threading.Thread(target=lambda: big.append(c.chat("x" * 7_800_000)))
    thread.start()
    time.sleep(0.3)
    normal = [c.chat(f"Say {i}.", max_tokens=2) for i in range(6)]
    thread.join()
    codes = [r.status_code for r in normal]
    error = big[0].json().get("error", {}) if big[0].status_code != 200 else {}
    held = codes == [200] * 6 and error.get("code") == "context_length_exceeded"
    return Result(
        "prompt past the context", held,
        f"normal: {codes}; 7.8 MB: {big[0].status_code} {error.get('code')} "
        f"(all done in {time.monotonic() - t0:.1f} s)",
    )  # fmt: skip


def kill_at_first_token(c: Chaos, proc: subprocess.Popen[bytes]) -> tuple[str, int]:
    """Kill the control plane at a long prompt's first chunk: the request id, and the
    prompt's exact token count."""
    prompt = " ".join(["internationalization"] * 1500)
    first = c.chat(prompt, max_tokens=1)
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"authorization": f"Bearer {c.key}"}
    with httpx.stream("POST", c.url + CHAT, json=body, headers=headers, timeout=120) as r:
        request_id = r.headers["x-request-id"]
        with contextlib.suppress(httpx.HTTPError):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    os.killpg(proc.pid, signal.SIGKILL)  # the control plane and its workers
    proc.wait()
    return request_id, prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_pg = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
    parser.add_argument(
        "--postgres", default=os.environ.get("HOTPOOL_TEST_POSTGRES_URL", default_pg)
    )
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    args = parser.parse_args()
    uri = smollm2_snapshot(args.cache.resolve(), "bf16")
    results: list[Result] = []
    with fresh_database(args.postgres, "hotpool_chaos") as db_url:
        Database(db_url).upgrade()
        store_db = Database(db_url)
        store = KeyStore(store_db)
        _, operator = store.create(DEFAULT_TENANT_ID, parse_scopes("operator"))
        _, unseen = store.create(DEFAULT_TENANT_ID, parse_scopes("invoke"))
        store_db.dispose()
        target = make_url(db_url)
        proxy = TcpProxy((target.host or "127.0.0.1", target.port or 5432))
        proxied = target.set(host="127.0.0.1", port=proxy.port)
        env = {"HOTPOOL_DATABASE_URL": proxied.render_as_string(hide_password=False),
               "HOTPOOL_AUTH": "keys", "HOTPOOL_AUTH_TIMEOUT_S": "1",
               "HOTPOOL_MAX_WORKERS": "1", "HOTPOOL_WARM_WORKERS": "0"}  # fmt: skip
        home = Path(os.environ.get("TMPDIR", "/tmp")) / f"hotpool-chaos-{uuid.uuid4().hex[:8]}"
        home.mkdir()
        with serve(home, env) as (url, proc):
            c = Chaos(url, operator, unseen)
            spec = {"name": MODEL, "snapshot_uri": uri}
            r = httpx.post(f"{url}/v1/deployments", json=spec, timeout=60,
                           headers={"authorization": f"Bearer {operator}"})  # fmt: skip
            assert r.status_code == 201, r.text
            assert c.chat("Warm up.", max_tokens=1).status_code == 200
            for probe in (schema_storm, bodies_in_one_read):
                results.append(probe(c))
                print(f"{results[-1].probe}: done", file=sys.stderr)
            for kind in ("stopped", "frozen"):
                results.append(database_outage(c, proxy, kind, db_url))
                print(f"database {kind}: done", file=sys.stderr)
            results.append(prompt_past_the_context(c))
            request_id, prompt_tokens = kill_at_first_token(c, proc)
        with serve(home, env) as (url, _):
            db = Database(db_url)

            def rows() -> list[UsageRecord]:
                return [e for e in Ledger(db).events(limit=100_000) if e.request_id == request_id]

            try:
                wait_for("the restart to bill it", rows, 30)
                [row] = rows()
            finally:
                db.dispose()
            held = row.prompt_tokens == prompt_tokens and row.completion_tokens >= 1
            results.append(Result(
                "kill -9 at the first token", held,
                f"billed {row.status} {row.prompt_tokens} + {row.completion_tokens} "
                f"(the prompt is {prompt_tokens} tokens)",
            ))  # fmt: skip
    width = max(len(r.probe) for r in results)
    print(f"| {'probe':<{width}} | held | numbers |")
    print(f"|{'-' * (width + 2)}|------|---------|")
    for r in results:
        print(f"| {r.probe:<{width}} | {'yes' if r.held else 'NO':<4} | {r.numbers} |")
    sys.exit(0 if all(r.held for r in results) else 1)


if __name__ == "__main__":
    main()
