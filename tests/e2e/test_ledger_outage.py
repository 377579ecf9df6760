"""The ledger loses nothing when PostgreSQL goes away under load or the control plane dies.

A real ``hotpool serve`` talks to a fresh database on the shared PostgreSQL server through a
TCP proxy started here, so a test cuts *its* database for a few seconds while the server
itself (which other tests use) keeps running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import running_server, worker_pids
from sqlalchemy import make_url

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from scratch_postgres import fresh_database
from tcp_proxy import TcpProxy

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore, parse_scopes
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import DEFAULT_TENANT_ID
from hotpool.platform.inflight import RESTART_ERROR

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

DEFAULT_POSTGRES_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    """A fresh database on the test server, migrated with `hotpool db upgrade`."""
    admin_url = os.environ.get("HOTPOOL_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    if os.environ.get("HOTPOOL_TEST_SKIP_POSTGRES") == "1":
        pytest.skip("HOTPOOL_TEST_SKIP_POSTGRES=1")
    with fresh_database(admin_url, "hotpool_e2e") as url:
        env = {**os.environ, "HOTPOOL_DATABASE_URL": url}
        cmd = [sys.executable, "-m", "hotpool", "db", "upgrade"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        yield url


@pytest.fixture(scope="module")
def proxy(database_url: str) -> Iterator[TcpProxy]:
    url = make_url(database_url)
    p = TcpProxy((url.host or "127.0.0.1", url.port or 5432))
    yield p
    p.close()


def _through(proxy: TcpProxy, database_url: str) -> str:
    url = make_url(database_url).set(host="127.0.0.1", port=proxy.port)
    return url.render_as_string(hide_password=False)


def _ledger(database_url: str) -> dict[str, list[UsageRecord]]:
    """request_id -> its rows, read straight from the database (not through the proxy)."""
    db = Database(database_url)
    try:
        rows: dict[str, list[UsageRecord]] = {}
        for r in Ledger(db).events(limit=1_000_000):
            rows.setdefault(r.request_id, []).append(r)
        return rows
    finally:
        db.dispose()


def _billed_once(
    ids: set[str], spool: Path, database_url: str, timeout_s: float
) -> dict[str, list[UsageRecord]]:
    """The ledger once the spool is replayed and holds every one of ``ids``, each once."""

    def replayed() -> bool:
        spooled = any(spool.glob("usage*.jsonl"))
        return not spooled and ids <= _ledger(database_url).keys()

    _wait_for("the spool to be replayed", replayed, timeout_s)
    rows = _ledger(database_url)
    assert {rid: len(rows[rid]) for rid in ids} == dict.fromkeys(ids, 1)
    return rows


def _wait_for(what: str, check: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_postgres_cut_for_seconds_under_load_loses_no_request_and_doubles_none(
    tmp_path: Path, smollm2_snapshot_bf16: Path, database_url: str, proxy: TcpProxy
) -> None:
    uri = f"file://{smollm2_snapshot_bf16}"
    env = {
        "HOTPOOL_DATABASE_URL": _through(proxy, database_url),
        "HOTPOOL_MAX_WORKERS": "1",
        "HOTPOOL_WARM_WORKERS": "0",
    }
    with running_server(tmp_path, uri, env, f"outage={uri}") as srv:
        body = {"model": "outage", "prompt": "One, two,", "max_tokens": 2}
        first = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)  # cold start
        assert first.status_code == 200, first.text
        sent: list[tuple[str, float, int]] = []  # request id, when it finished, status
        stop = threading.Event()

        def load() -> None:
            with httpx.Client(timeout=60) as client:
                while not stop.is_set():
                    r = client.post(f"{srv.url}/v1/completions", json=body)
                    sent.append((r.headers["x-request-id"], time.monotonic(), r.status_code))

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(2)
        cut_at = time.monotonic()
        proxy.cut()
        time.sleep(5)
        proxy.restore()
        back_at = time.monotonic()
        time.sleep(2)
        stop.set()
        for t in threads:
            t.join()

        assert {status for _, _, status in sent} == {200}  # serving never noticed the outage
        during = [rid for rid, at, _ in sent if cut_at < at < back_at]
        assert len(during) >= 10 and proxy.refused > 0  # the outage was real, under load
        ids = {first.headers["x-request-id"]} | {rid for rid, _, _ in sent}
        assert len(ids) == len(sent) + 1

        rows = _billed_once(ids, tmp_path / "spool", database_url, 30)
        assert all(rows[rid][0].completion_tokens == 2 for rid in ids)
        assert "spooling" in srv.log()


@pytest.mark.parametrize(
    ("prompt", "kill_at"),
    [("Once upon a time", 40), (" ".join(["internationalization"] * 1500), 1)],
    ids=["mid-stream", "first-token"],
)
def test_a_stream_cut_by_kill_9_is_billed_as_partial_after_the_restart(
    tmp_path: Path, smollm2_snapshot_bf16: Path, database_url: str, proxy: TcpProxy,
    prompt: str, kill_at: int,
) -> None:  # fmt: skip
    """Killed mid-stream, or at its first token (issue 46: a 6,423-token prompt was billed
    0 + 0, the journal's first tokens line being 16 tokens or a second away): the restart
    bills what the client was streamed, and the whole prompt."""
    uri = f"file://{smollm2_snapshot_bf16}"
    env = {
        "HOTPOOL_DATABASE_URL": _through(proxy, database_url),
        "HOTPOOL_MAX_WORKERS": "1",
        "HOTPOOL_WARM_WORKERS": "0",
    }
    body = {"model": "crash", "prompt": prompt, "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    with running_server(tmp_path, uri, env, f"crash={uri}") as srv:
        # The same prompt once whole: its token count, and its prefix cached (the stream
        # below then reaches its first token at once, as in the report).
        r = httpx.post(
            f"{srv.url}/v1/completions", json={**body, "stream": False, "max_tokens": 1},
            timeout=300,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        chunks = 0
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
            request_id = r.headers["x-request-id"]
            try:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if chunks == kill_at:
                            os.kill(srv.proc.pid, signal.SIGKILL)
            except httpx.HTTPError:
                pass  # the connection dies with the server
        assert srv.proc.wait(timeout=10) == -signal.SIGKILL
        assert request_id not in _ledger(database_url)
        for pid in worker_pids(tmp_path):  # orphans: they would exit on their own, later
            os.kill(pid, signal.SIGKILL)

    with running_server(tmp_path, uri, env) as srv:  # same database, same spool folder
        _wait_for("the restart to bill it", lambda: request_id in _ledger(database_url), 15)
        [row] = _ledger(database_url)[request_id]
        assert (row.status, row.error, row.deployment) == ("partial", RESTART_ERROR, "crash")
        assert row.prompt_tokens == prompt_tokens
        if kill_at == 1:
            assert 1 <= row.completion_tokens < 400
        else:
            assert 16 <= row.completion_tokens < 400
        assert "left unrecorded (1 cut short)" in srv.log()
        assert json.loads(httpx.get(f"{srv.url}/readyz").text)["status"] == "ready"


def test_keys_auth_rides_out_a_database_stopped_then_frozen(
    tmp_path: Path, smollm2_snapshot_bf16: Path, database_url: str, proxy: TcpProxy
) -> None:
    """Issue 46: with HOTPOOL_AUTH=keys, PostgreSQL stopped for 20 s made 97% of requests
    500s, and frozen it hung every request. Now a key checked recently is served through
    both (no request waits past the lookup timeout and a little), a key never checked is a
    503 with Retry-After, and every request served is billed once the database is back."""
    store_db = Database(database_url)
    store = KeyStore(store_db)
    _, key = store.create(DEFAULT_TENANT_ID, parse_scopes("invoke"))
    _, unseen = store.create(DEFAULT_TENANT_ID, parse_scopes("invoke"))
    store_db.dispose()
    uri = f"file://{smollm2_snapshot_bf16}"
    env = {
        "HOTPOOL_DATABASE_URL": _through(proxy, database_url),
        "HOTPOOL_AUTH": "keys",
        "HOTPOOL_AUTH_TIMEOUT_S": "1",
        "HOTPOOL_MAX_WORKERS": "1",
        "HOTPOOL_WARM_WORKERS": "0",
    }
    body = {"model": "keyed", "prompt": "One, two,", "max_tokens": 2}

    def post(token: str) -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        r = httpx.post(
            f"{srv.url}/v1/completions", json=body, timeout=60,
            headers={"authorization": f"Bearer {token}"},
        )  # fmt: skip
        return r, time.monotonic() - t0

    with running_server(tmp_path, uri, env, f"keyed={uri}") as srv:
        first, _ = post(key)  # the cold start, and the key's first check
        assert first.status_code == 200, first.text
        sent: list[tuple[str, int, float]] = []  # request id, status, seconds
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                r, took = post(key)
                sent.append((r.headers["x-request-id"], r.status_code, took))

        threads = [threading.Thread(target=load) for _ in range(3)]
        for t in threads:
            t.start()
        others: list[tuple[str, httpx.Response, float]] = []  # keys never checked, mid-outage
        try:
            time.sleep(1)
            for outage, begin, end in (("stopped", proxy.cut, proxy.restore),
                                       ("frozen", proxy.freeze, proxy.thaw)):  # fmt: skip
                begin()
                time.sleep(3)  # past the key cache: every check now needs the database
                others += [(outage, *post(unseen)), (outage, *post("hp_not_a_key_at_all"))]
                time.sleep(1)
                end()
                time.sleep(2)
        finally:
            proxy.restore()
            proxy.thaw()
            stop.set()
            for t in threads:
                t.join()
        back, _ = post(unseen)  # checked now that the database answers
        assert back.status_code == 200, back.text

        statuses = [status for _, status, _ in sent]
        assert set(statuses) == {200} and len(statuses) >= 20, statuses
        assert max(took for _, _, took in sent) < 5  # the 1 s lookup timeout, and serving
        for i, (outage, r, took) in enumerate(others):
            assert took < 5, (outage, took)
            if i % 2:  # not a key at all: refused without asking the database
                assert r.status_code == 401, (outage, r.text)
                continue
            assert r.status_code == 503, (outage, r.text)
            assert r.headers["retry-after"] == "5"
            assert r.json()["error"]["code"] == "auth_unavailable"
        ids = {first.headers["x-request-id"], back.headers["x-request-id"]}
        ids |= {rid for rid, _, _ in sent}

        _billed_once(ids, tmp_path / "spool", database_url, 60)
        assert " 500 " not in srv.log() and "Traceback" not in srv.log()
