"""Step load against a deployment at zero: autoscaling vs a fixed single replica.

A real ``hotpool serve`` (control plane + local worker processes, SmolLM2-135M bf16 on the
CPU) gets a step load: one streaming client at t=0, then at ``--step-at`` seconds the load
jumps to ``--streams`` concurrent streaming clients. Every client sends completions of
``--max-tokens`` output tokens (EOS ignored) back to back until ``--step-at + --hold``
seconds, and measures its own time to first token (TTFT) and end-to-end time. Two phases
in one run, each on a fresh server (the API has no delete, and each phase should own the
machine):

  elastic  the deployment starts at zero replicas (min 0, max ``--max-replicas``,
           ``--target-concurrency`` per replica), one warm worker idle, up to
           ``--max-workers`` worker processes: the first request pays a cold start, the step
           makes the autoscaler add replicas.
  fixed    one replica (min = max = 1), loaded and ready before t=0; the peer.

Per phase: TTFT of the first request (the cold start for elastic), TTFT p50/p90/max of the
requests started at or after the step, queue waits (the ledger's ``queue_seconds``: time a
request waited for a ready replica), output tokens/s from the step to the end of the load
and from the moment every added replica was ready (steady state), the time from the step
until every added replica was ready (the replica list polled every 0.1 s), and the scale
events during the load and a ``--tail`` after it (the scale-down window passes within it).
A flap is a scale-up after a scale-down. The run exits nonzero if any request failed or a
deployment flapped.

    python benchmarks/bench_autoscale.py
    python benchmarks/bench_autoscale.py --streams 32 --max-workers 8 --hold 60 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from plan_check import run_plan_check
from serve_process import pct, serve, smollm2_snapshot, wait_for  # benchmarks/ is the script folder

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "bench"
PROMPT = "Once upon a time, in a town by the sea, there lived"


# --- the server (the pieces of tests/e2e/server_process.py a benchmark needs) ---------------


@dataclass
class Server:
    url: str
    home: Path
    proc: subprocess.Popen[bytes]

    def get(self, path: str, **params: object) -> Any:
        r = httpx.get(self.url + path, params=params, timeout=10)  # type: ignore[arg-type]
        r.raise_for_status()
        return r.json()

    def replicas(self, name: str) -> list[dict[str, Any]]:
        return self.get(f"/v1/deployments/{name}")["replicas"]  # type: ignore[no-any-return]

    def scale_events(self, name: str) -> list[dict[str, Any]]:
        """Every scale event of ``name``, oldest first."""
        data = self.get(f"/v1/deployments/{name}/events", limit=1000)["data"]
        return list(reversed(data))

    def gauge(self, metric: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(metric + " "):
                return float(line.split()[1])
        return math.nan

    def ledger(self, name: str) -> list[UsageRecord]:
        db = Database(f"sqlite:///{self.home / 'hotpool.db'}")
        try:
            return Ledger(db).events(name, limit=100_000)
        finally:
            db.dispose()


@contextlib.contextmanager
def running_server(home: Path, env: dict[str, str]) -> Iterator[Server]:
    """``hotpool serve`` with a fresh ``HOTPOOL_HOME=home``."""
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    with serve(home, env) as (url, proc):
        yield Server(url, home, proc)


# --- load ----------------------------------------------------------------------------------


@dataclass
class Result:
    client: int
    start: float  # seconds since t0
    first: float | None = None  # first chunk, seconds since t0
    end: float = 0.0
    tokens: int = 0  # completion tokens (the usage chunk)
    request_id: str = ""
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start


def one_stream(client: httpx.Client, url: str, model: str, max_tokens: int, t0: float) -> Result:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = Result(client=-1, start=time.monotonic() - t0)
    done = False
    try:
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            res.request_id = r.headers.get("x-request-id", "")
            if r.status_code != 200:
                r.read()
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    continue
                if chunk.get("choices") and res.first is None:
                    res.first = time.monotonic() - t0
                if chunk.get("usage"):
                    res.tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.end = time.monotonic() - t0
    if res.error is None and not done:
        res.error = "stream ended without [DONE]"
    elif res.error is None and res.tokens != max_tokens:
        res.error = f"{res.tokens} completion tokens, asked for {max_tokens}"
    return res


def run_client(
    i: int, url: str, model: str, args: argparse.Namespace, t0: float, out: list[Result]
) -> None:
    start_at = t0 + (0.0 if i == 0 else args.step_at)
    stop_at = t0 + args.step_at + args.hold
    time.sleep(max(0.0, start_at - time.monotonic()))
    with httpx.Client(timeout=args.request_timeout) as client:
        while time.monotonic() < stop_at:
            res = one_stream(client, url, model, args.max_tokens, t0)
            res.client = i
            out.append(res)  # list.append is atomic
            if res.error is not None:
                time.sleep(0.5)  # do not spin on a failing server


@dataclass
class Poller:
    """The deployment's replicas every ``interval_s`` on a thread: state changes, timeline."""

    srv: Server
    name: str
    t0: float
    interval_s: float = 0.1
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> facts
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)  # t, live, ready, q
    errors: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic() - self.t0
            try:
                dep = self.srv.get(f"/v1/deployments/{self.name}")
            except (httpx.HTTPError, ValueError):
                self.errors += 1
            else:
                reps = dep["replicas"]
                for r in reps:
                    facts = self.seen.setdefault(r["id"], {"seen": t, "ready": None, "gone": None})
                    if r["state"] == "ready" and facts["ready"] is None:
                        facts["ready"] = t
                    facts.update(
                        pid=r["pid"],
                        state=r["state"],
                        tier=r.get("weights_tier"),
                        cold_start_seconds=r.get("cold_start_seconds"),
                        phases=r.get("cold_start_phases"),
                    )
                ids = {r["id"] for r in reps}
                for rid, facts in self.seen.items():
                    if rid not in ids and facts["gone"] is None:
                        facts["gone"] = t
                live = sum(r["state"] != "draining" for r in reps)
                ready = sum(r["state"] == "ready" for r in reps)
                row = (t, live, ready, int(dep["queued_requests"]))
                if not self.timeline or self.timeline[-1][1:] != row[1:]:
                    self.timeline.append(row)
            self._stop.wait(self.interval_s)


# --- one phase -----------------------------------------------------------------------------


def tokens_per_s(results: list[Result], start: float, end: float) -> float:
    """Output tokens/s in [start, end], each request's tokens spread evenly over its
    generation (first chunk -> end of the stream)."""
    tokens = 0.0
    for x in results:
        lo, hi = (x.first if x.first is not None else x.start), x.end
        overlap = min(hi, end) - max(lo, start)
        if overlap > 0:
            tokens += x.tokens * overlap / max(hi - lo, 1e-9)
    return tokens / (end - start) if end > start else math.nan


def run_phase(
    name: str, scaling: dict[str, Any], env: dict[str, str], uri: str, args: argparse.Namespace
) -> dict[str, Any]:
    home = CACHE / "autoscale" / name
    print(f"[{name}] starting hotpool serve (HOTPOOL_HOME={home})", flush=True)
    with running_server(home, env) as srv:
        warm = int(env["HOTPOOL_WARM_WORKERS"])
        wait_for("the warm pool", lambda: srv.gauge("hotpool_idle_workers") >= warm, 300)
        r = httpx.post(
            srv.url + "/v1/deployments",
            json={"name": name, "snapshot_uri": uri, **scaling},
            timeout=30,
        )
        if r.status_code != 201:
            raise RuntimeError(f"deploy {name}: HTTP {r.status_code} {r.text}")
        n = scaling["min_replicas"]
        wait_for(
            f"{n} ready replica(s)",
            lambda: sum(x["state"] == "ready" for x in srv.replicas(name)) >= n,
            300,
        )
        events_before = {e["id"] for e in srv.scale_events(name)}
        replicas_before = {x["id"] for x in srv.replicas(name)}

        t0 = time.monotonic()
        poller = Poller(srv, name, t0)
        poller.start()
        results: list[Result] = []
        threads = [
            threading.Thread(
                target=run_client, args=(i, srv.url, name, args, t0, results), daemon=True
            )
            for i in range(args.streams)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        load_end = time.monotonic() - t0
        print(
            f"[{name}] load done at {load_end:.1f}s, {len(results)} requests; "
            f"watching {args.tail:g}s more",
            flush=True,
        )
        time.sleep(args.tail)
        poller.stop()
        events = [e for e in srv.scale_events(name) if e["id"] not in events_before]
        ids = {x.request_id for x in results if x.request_id}
        rows: list[UsageRecord] = []
        with contextlib.suppress(TimeoutError):  # written off the request path
            wait_for("ledger rows", lambda: len(_rows(srv, name, ids, rows)) >= len(ids), 15)

    return summarize(name, results, rows, events, poller, replicas_before, load_end, home, args)


def _rows(srv: Server, name: str, ids: set[str], into: list[UsageRecord]) -> list[UsageRecord]:
    into[:] = [r for r in srv.ledger(name) if r.request_id in ids]
    return into


def summarize(
    name: str,
    results: list[Result],
    rows: list[UsageRecord],
    events: list[dict[str, Any]],
    poller: Poller,
    replicas_before: set[str],
    load_end: float,
    home: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    step = args.step_at
    ok = [x for x in results if x.error is None]
    failed = [x for x in results if x.error is not None]
    first = min(results, key=lambda x: x.start) if results else None
    after = [x.ttft for x in ok if x.start >= step and x.ttft is not None]
    wave1 = []  # the first request of each client that joined at the step
    for c in range(1, args.streams):
        mine = [x for x in results if x.client == c]
        if mine and mine[0].error is None and mine[0].ttft is not None:
            wave1.append(mine[0].ttft)
    decode = [
        (x.tokens - 1) / (x.end - x.first)
        for x in ok
        if x.first is not None and x.end > x.first and x.tokens > 1
    ]
    queue = [r.queue_seconds for r in rows if r.queue_seconds is not None]
    ledger_bad = [r for r in rows if r.status != "completed"]
    added = {rid: f for rid, f in poller.seen.items() if rid not in replicas_before}
    # The replica the first request started (elastic) vs the ones the step added.
    by_seen = sorted(added.items(), key=lambda kv: kv[1]["seen"])
    step_added = [f for _, f in by_seen if f["seen"] >= step - 0.05]
    first_added = [f for _, f in by_seen if f["seen"] < step - 0.05]
    never_ready = [f for f in step_added if f["ready"] is None]
    ready_after_step = [f["ready"] - step for f in step_added if f["ready"] is not None]
    # Steady state: from the moment every replica the step asked for was ready.
    all_ready = step + max(ready_after_step) if ready_after_step and not never_ready else step
    ups = [e for e in events if e["to_replicas"] > e["from_replicas"]]
    downs = [e for e in events if e["to_replicas"] < e["from_replicas"]]
    first_down = next(
        (i for i, e in enumerate(events) if e["to_replicas"] < e["from_replicas"]), None
    )
    flaps = (
        0
        if first_down is None
        else sum(e["to_replicas"] > e["from_replicas"] for e in events[first_down:])
    )
    return {
        "phase": name,
        "home": str(home),
        "requests": len(results),
        "failed": len(failed),
        "failures": sorted({x.error or "" for x in failed})[:5],
        "ledger_rows": len(rows),
        "ledger_not_completed": len(ledger_bad),
        "first_ttft_s": first.ttft if first else None,
        "first_request_queue_s": next(
            (r.queue_seconds for r in rows if first and r.request_id == first.request_id), None
        ),
        "step_ttft_p50_s": pct(after, 0.5),
        "step_ttft_p90_s": pct(after, 0.9),
        "step_ttft_max_s": pct(after, 1.0),
        "wave1_ttft_p90_s": pct(wave1, 0.9),
        "queue_p50_s": pct(queue, 0.5),
        "queue_p90_s": pct(queue, 0.9),
        "queue_max_s": pct(queue, 1.0),
        "queued_requests": sum(q > 0.01 for q in queue),
        "step_tokens_per_s": tokens_per_s(ok, step, load_end),
        "steady_tokens_per_s": tokens_per_s(ok, all_ready, load_end),
        "stream_decode_tokens_per_s_p50": pct(decode, 0.5),
        "first_replica_ready_s": min((f["ready"] for f in first_added if f["ready"]), default=None),
        "replicas_added_by_step": len(step_added),
        "replicas_never_ready": len(never_ready),
        "all_added_ready_after_step_s": max(ready_after_step)
        if step_added and not never_ready
        else None,
        "replica_ready_after_step_s": sorted(ready_after_step),
        "replica_cold_start_s": [f["cold_start_seconds"] for _, f in by_seen],
        "replica_tiers": [f["tier"] for _, f in by_seen],
        "max_ready_replicas": max((row[2] for row in poller.timeline), default=0),
        "scale_ups": len(ups),
        "scale_downs": len(downs),
        "flaps": flaps,
        "scale_events": [(e["from_replicas"], e["to_replicas"], e["reason"]) for e in events],
        "timeline": [(round(t, 1), live, ready, q) for t, live, ready, q in poller.timeline],
        "poll_errors": poller.errors,
        "load_end_s": load_end,
    }


# --- report --------------------------------------------------------------------------------


def fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


ROWS = [  # (key, label, digits)
    ("first_ttft_s", "TTFT of the first request (s)", 2),
    ("step_ttft_p50_s", "TTFT p50 after the step (s)", 2),
    ("step_ttft_p90_s", "TTFT p90 after the step (s)", 2),
    ("step_ttft_max_s", "TTFT max after the step (s)", 2),
    ("wave1_ttft_p90_s", "TTFT p90, first wave of the step (s)", 2),
    ("queue_p50_s", "queue wait p50 (s)", 3),
    ("queue_p90_s", "queue wait p90 (s)", 3),
    ("queue_max_s", "queue wait max (s)", 3),
    ("queued_requests", "requests that waited > 10 ms", 0),
    ("step_tokens_per_s", "output tokens/s from the step", 1),
    ("steady_tokens_per_s", "output tokens/s once all replicas ready", 1),
    ("stream_decode_tokens_per_s_p50", "per-stream decode tokens/s p50", 1),
    ("first_replica_ready_s", "first replica ready (s after t=0)", 2),
    ("replicas_added_by_step", "replicas added by the step", 0),
    ("all_added_ready_after_step_s", "all added replicas ready (s after step)", 2),
    ("max_ready_replicas", "most ready replicas", 0),
    ("scale_ups", "scale-up events", 0),
    ("scale_downs", "scale-down events", 0),
    ("flaps", "flaps (up after a down)", 0),
    ("requests", "requests", 0),
    ("failed", "failed requests", 0),
]


def report(phases: list[dict[str, Any]], args: argparse.Namespace, threads: dict[str, int]) -> None:
    el, fx = phases
    print()
    print(
        f"SmolLM2-135M bf16 on CPU ({os.cpu_count()} cores); load 1 -> {args.streams} streams at "
        f"t={args.step_at:g}s for {args.hold:g}s, {args.max_tokens} output tokens each; elastic: "
        f"max {args.max_replicas} replicas x target {args.target_concurrency}, "
        f"{args.max_workers} workers x {threads['elastic']} threads; fixed: 1 replica x "
        f"{threads['fixed']} threads"
    )
    print()
    print("| metric | elastic | fixed |")
    print("|---|---:|---:|")
    for key, label, digits in ROWS:
        print(f"| {label} | {fmt(el[key], digits)} | {fmt(fx[key], digits)} |")
    ratios = {
        "throughput": el["step_tokens_per_s"] / fx["step_tokens_per_s"],
        "steady_throughput": el["steady_tokens_per_s"] / fx["steady_tokens_per_s"],
        "ttft_p90": el["step_ttft_p90_s"] / fx["step_ttft_p90_s"],
    }
    print()
    print(
        f"elastic / fixed: output tokens/s {ratios['throughput']:.2f}x from the step, "
        f"{ratios['steady_throughput']:.2f}x once all replicas were ready, "
        f"TTFT p90 after the step {ratios['ttft_p90']:.2f}x (lower is better)"
    )
    for p in phases:
        print(f"{p['phase']}: scale events {p['scale_events']}")
        print(
            f"{p['phase']}: added replicas ready {fmt(p['replica_ready_after_step_s'])} s "
            f"after the step; cold starts {p['replica_cold_start_s']} s, tiers "
            f"{p['replica_tiers']}"
        )
        print(f"{p['phase']}: (t, live, ready, queued) {p['timeline']}")
        if p["failed"]:
            print(f"{p['phase']}: FAILED requests: {p['failures']}")
    print()
    print(
        "notes: on a CPU box the replicas share the same cores, so more replicas add no compute "
        "and elastic ~ fixed on throughput is the best to expect; elastic also pays its cold "
        "starts (which compete with serving for the same cores) and, by default, runs each "
        "replica on cores // max-workers threads where the fixed replica has every core "
        "(--elastic-threads / --fixed-threads change that). What this run "
        "checks is the scaling itself: replicas up within seconds of the step, no flapping, "
        "no failed request. queue wait is the time a request waited for a ready replica (the "
        "router never queues behind a ready one, so the fixed replica's is ~0); waiting "
        "inside a busy replica's batch shows in TTFT. Logs: <home>/serve.log, <home>/logs/."
    )
    summary = {
        "bench": "autoscale",
        "args": vars(args),
        "threads": threads,
        "phases": phases,
        "ratios": ratios,
    }
    print(json.dumps(summary, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))


def snapshot() -> str:
    return smollm2_snapshot(CACHE, "bf16")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams after the step")
    ap.add_argument("--step-at", type=float, default=2.0, help="seconds after the first request")
    ap.add_argument("--hold", type=float, default=30.0, help="seconds the step load lasts")
    ap.add_argument(
        "--tail",
        type=float,
        default=None,
        help="seconds to watch after the load (default: scale-down window + 8)",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-workers", type=int, default=4, help="elastic phase's worker processes")
    ap.add_argument("--max-replicas", type=int, default=4)
    ap.add_argument("--target-concurrency", type=int, default=4)
    ap.add_argument("--warm-workers", type=int, default=1)
    ap.add_argument("--scale-down-window", type=float, default=10.0)
    ap.add_argument("--idle-timeout", type=float, default=600.0)
    ap.add_argument(
        "--elastic-threads",
        type=int,
        default=None,
        help="CPU threads per elastic worker (default: cores // max workers)",
    )
    ap.add_argument(
        "--fixed-threads",
        type=int,
        default=None,
        help="CPU threads of the fixed replica (default: all cores)",
    )
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--only", choices=["elastic", "fixed"], help="run one phase (no ratios)")
    ap.add_argument("--json", help="also write the summary to this file")
    ap.add_argument(
        "--plan-check",
        action="store_true",
        help="instead: the capacity planner's predicted TTFT p95 against a measured run "
        "(benchmarks/plan_check.py)",
    )
    ap.add_argument("--plan-requests", type=int, default=40, help="requests per rate")
    ap.add_argument("--plan-words", type=int, default=150, help="words of each prompt")
    ap.add_argument("--plan-output-tokens", type=int, default=8)
    args = ap.parse_args()
    if args.plan_check:
        return run_plan_check(args, CACHE)
    if args.tail is None:
        args.tail = args.scale_down_window + 8
    cores = os.cpu_count() or 1
    threads = {
        "elastic": args.elastic_threads or max(1, cores // args.max_workers),
        "fixed": args.fixed_threads or cores,
    }
    uri = snapshot()
    common = {
        "HOTPOOL_WARM_WORKERS": str(args.warm_workers),
        "HOTPOOL_SCALE_DOWN_WINDOW_S": str(args.scale_down_window),
    }
    plan = {
        "elastic": (
            {
                "min_replicas": 0,
                "max_replicas": args.max_replicas,
                "target_concurrency": args.target_concurrency,
                "idle_timeout_s": args.idle_timeout,
            },
            {
                **common,
                "HOTPOOL_MAX_WORKERS": str(args.max_workers),
                "HOTPOOL_WORKER_THREADS": str(threads["elastic"]),
            },
        ),
        "fixed": (
            {
                "min_replicas": 1,
                "max_replicas": 1,
                "target_concurrency": args.streams,
                "idle_timeout_s": args.idle_timeout,
            },
            {
                **common,
                "HOTPOOL_MAX_WORKERS": "1",
                "HOTPOOL_WARM_WORKERS": "1",
                "HOTPOOL_WORKER_THREADS": str(threads["fixed"]),
            },
        ),
    }
    phases = []
    for name, (scaling, env) in plan.items():
        if args.only and name != args.only:
            continue
        phases.append(run_phase(name, scaling, env, uri, args))
    if len(phases) == 2:
        report(phases, args, threads)
    else:
        print(json.dumps(phases[0], default=str))
    bad = [p["phase"] for p in phases if p["failed"] or p["flaps"] or p["ledger_not_completed"]]
    if bad:
        print(f"FAIL: failed requests or flapping in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
