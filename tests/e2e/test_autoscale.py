"""Autoscaling, dead workers and restarts with real ``hotpool serve`` and worker processes.

Each scenario of issue 6 against a real control plane: 0 -> 1 -> N -> 0 under concurrent
streams, ``kill -9`` of a worker mid-stream and before the first token, a worker that stops
heartbeating (SIGSTOP), a control-plane restart, more deployments than workers, and a queue
wait that times out.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import Server, running_server, worker_pids

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"


@dataclass
class Stream:
    request_id: str = ""
    texts: list[str] = field(default_factory=list)
    finish: str | None = None
    error: dict[str, Any] | None = None
    error_usage: dict[str, Any] | None = None  # what the in-band error says was billed
    done: bool = False
    status: int = 0


def stream(
    server: Server,
    model: str,
    max_tokens: int,
    on_chunk: Any = None,
    timeout: float = 300,
    stop: threading.Event | None = None,
) -> Stream:
    """A streamed completion read to the end; ``on_chunk(n)`` after each text chunk. Once
    ``stop`` is set the client goes away after its next chunk."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    out = Stream()
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=timeout) as r:
        out.status, out.request_id = r.status_code, r.headers["x-request-id"]
        if r.status_code != 200:
            r.read()
            out.error = r.json()["error"]
            return out
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                break
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                out.error, out.error_usage = chunk["error"], chunk.get("usage")
                continue
            choice = chunk["choices"][0]
            out.texts.append(choice["text"])
            out.finish = choice["finish_reason"] or out.finish
            if on_chunk is not None:
                on_chunk(len(out.texts))
            if stop is not None and stop.is_set():
                break
    return out


def complete(
    server: Server, model: str, max_tokens: int = 4, timeout: float = 300
) -> httpx.Response:
    body = {"model": model, "prompt": "One, two,", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(server.url + COMPLETIONS, json=body, timeout=timeout)


def ready_pids(server: Server, name: str) -> list[int]:
    return [r["pid"] for r in server.replicas(name) if r["state"] == "ready"]


def ups(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["to_replicas"] > e["from_replicas"]]


def alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def elastic(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("hotpool-autoscale")
    env = {
        "HOTPOOL_MAX_WORKERS": "3",
        "HOTPOOL_WARM_WORKERS": "1",
        "HOTPOOL_SCALE_DOWN_WINDOW_S": "2",
        # Short, for the silent worker's test, yet several beats (every 2 s) long: a loaded
        # CI machine delays a busy worker's beat by seconds, and that is not a death.
        "HOTPOOL_HEARTBEAT_TIMEOUT_S": "10",
    }
    with running_server(home, f"file://{smollm2_snapshot_bf16}", env) as srv:
        yield srv
    assert worker_pids(home) == [], "shutdown left worker processes behind"


def test_zero_to_n_under_concurrent_streams_then_back_to_zero(elastic: Server) -> None:
    elastic.deploy("elastic", max_replicas=2, target_concurrency=2, idle_timeout_s=4)
    results: list[Stream] = []
    t0 = time.monotonic()
    threads = [
        threading.Thread(target=lambda: results.append(stream(elastic, "elastic", 48)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    # Four streams at two per replica: a second replica is asked for at once.
    elastic.wait_for("a second replica", lambda: len(elastic.replicas("elastic")) == 2, 5)
    asked_within = time.monotonic() - t0
    for t in threads:
        t.join()
    assert len(results) == 4
    for r in results:
        assert r.status == 200 and r.error is None and r.done, r
        assert r.finish == "length" and len("".join(r.texts)) > 0

    elastic.wait_for("scale to zero", lambda: not elastic.replicas("elastic"), 30)
    events = elastic.scale_events("elastic")
    up = ups(events)
    assert [(e["from_replicas"], e["to_replicas"]) for e in up] == [(0, 1), (1, 2)], events
    # The second replica is asked for as soon as load passes one replica's target (3 > 2).
    assert up[0]["reason"] == "request" and up[1]["reason"].startswith("load "), up
    assert up[0]["cold_start_seconds"] is not None and up[0]["cold_start_seconds"] > 0
    downs = [e for e in events if e not in up]
    assert len(downs) == 2 and downs[-1]["to_replicas"] == 0, events  # no flapping
    assert asked_within < 5


def test_kill_9_mid_stream_ends_cleanly_bills_partial_and_replaces_the_worker(
    elastic: Server,
) -> None:
    elastic.deploy("fragile", idle_timeout_s=120)
    assert complete(elastic, "fragile").status_code == 200
    (pid,) = ready_pids(elastic, "fragile")

    def kill_after_five(n: int) -> None:
        if n == 5:
            os.kill(pid, signal.SIGKILL)

    got = stream(elastic, "fragile", 400, on_chunk=kill_after_five)
    assert got.status == 200 and got.done
    assert got.error is not None and got.error["type"] == "api_error", got
    assert got.finish is None  # never claimed to have finished
    row = elastic.ledger_row(got.request_id)
    assert row.status == "partial"
    assert 5 <= row.completion_tokens < 400 and row.prompt_tokens > 0
    # The error says what it was billed (it said `usage: null`).
    assert got.error_usage is not None
    billed = (got.error_usage["prompt_tokens"], got.error_usage["completion_tokens"])
    assert billed == (row.prompt_tokens, row.completion_tokens)

    # The pool replaces the dead worker without waiting for the next request.
    elastic.wait_for(
        "a replacement", lambda: [p for p in ready_pids(elastic, "fragile") if p != pid], 60
    )
    reasons = [e["reason"] for e in elastic.scale_events("fragile")]
    assert any(r.startswith("worker died") for r in reasons), reasons
    assert "replacing a dead worker" in reasons
    assert complete(elastic, "fragile").status_code == 200


def test_worker_that_stops_heartbeating_is_replaced_and_its_request_retried(
    elastic: Server,
) -> None:
    elastic.deploy("frozen", idle_timeout_s=120)
    assert complete(elastic, "frozen").status_code == 200
    (pid,) = ready_pids(elastic, "frozen")
    os.kill(pid, signal.SIGSTOP)  # alive, but silent: no heartbeat, no answer
    try:
        t0 = time.monotonic()
        r = complete(elastic, "frozen", max_tokens=3)
        took = time.monotonic() - t0
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
    # No token had reached the client: the request moved to the replacement and succeeded.
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert elastic.ledger_row(r.headers["x-request-id"]).status == "completed"
    assert took < 60
    elastic.wait_for("the silent worker to be killed", lambda: not alive(pid), 10)
    reasons = [e["reason"] for e in elastic.scale_events("frozen")]
    assert any("no heartbeat" in r for r in reasons), reasons


def test_request_to_a_just_killed_idle_worker_is_retried(elastic: Server) -> None:
    elastic.deploy("sudden", idle_timeout_s=120)
    assert complete(elastic, "sudden").status_code == 200
    (pid,) = ready_pids(elastic, "sudden")
    os.kill(pid, signal.SIGKILL)
    r = complete(elastic, "sudden", max_tokens=3)  # before the pool has noticed, most likely
    assert r.status_code == 200, r.text
    assert elastic.ledger_row(r.headers["x-request-id"]).status == "completed"
    assert pid not in ready_pids(elastic, "sudden")


def test_control_plane_restart_keeps_deployments_and_serves_again(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    uri = f"file://{smollm2_snapshot_bf16}"
    env = {"HOTPOOL_MAX_WORKERS": "2", "HOTPOOL_WARM_WORKERS": "0"}
    with running_server(tmp_path, uri, env) as first:
        first.deploy("keeper", min_replicas=1, idle_timeout_s=60)
        first.deploy("lazy", idle_timeout_s=60)
        first.wait_for("keeper's min replica", lambda: bool(ready_pids(first, "keeper")), 60)
        assert complete(first, "lazy").status_code == 200
        before = httpx.get(f"{first.url}/v1/deployments").json()["data"]
        first.proc.kill()  # a crash, not a clean stop
        first.proc.wait()
        # Workers notice their parent is gone and exit: nothing holds the devices.
        first.wait_for("orphaned workers to exit", lambda: worker_pids(tmp_path) == [], 15)

    with running_server(tmp_path, uri, env) as second:
        after = httpx.get(f"{second.url}/v1/deployments").json()["data"]

        def settings(data: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
            return [(d["name"], d["snapshot_uri"], d["scaling"]) for d in data]

        assert settings(after) == settings(before)
        second.wait_for("keeper back at min_replicas", lambda: bool(ready_pids(second, "keeper")))
        assert complete(second, "keeper").status_code == 200
        assert complete(second, "lazy").status_code == 200


@pytest.fixture(scope="module")
def one_worker(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("hotpool-one-worker")
    env = {
        "HOTPOOL_MAX_WORKERS": "1",
        "HOTPOOL_WARM_WORKERS": "0",
        "HOTPOOL_PREEMPT_AFTER_S": "2",
    }
    with running_server(home, f"file://{smollm2_snapshot_bf16}", env) as srv:
        yield srv


def test_more_deployments_than_workers_take_turns_by_lru_eviction(one_worker: Server) -> None:
    for name in ("a", "b", "c"):
        one_worker.deploy(name, idle_timeout_s=300)
    served_by: list[tuple[int, str]] = []  # (worker pid, where the weights came from)
    for name in ("a", "b", "c", "a"):
        r = complete(one_worker, name)
        assert r.status_code == 200, (name, r.text)
        assert [d for d in ("a", "b", "c") if one_worker.replicas(d)] == [name]
        (replica,) = one_worker.replicas(name)
        served_by.append((replica["pid"], replica["weights_tier"]))
    # One process swapped the models: an evicted worker goes to the waiting cold start, and
    # the three deployments share one snapshot, whose weights stayed in its RAM.
    assert len({pid for pid, _ in served_by}) == 1, served_by
    assert [tier for _, tier in served_by[1:]] == ["host"] * 3
    evictions = [
        (name, e["reason"])
        for name in ("a", "b", "c")
        for e in one_worker.scale_events(name)
        if "evicted" in e["reason"]
    ]
    assert sorted(evictions) == [
        ("a", "evicted (least recently used) for b"),
        ("b", "evicted (least recently used) for c"),
        ("c", "evicted (least recently used) for a"),
    ]


def test_busy_deployment_cannot_starve_another(one_worker: Server) -> None:
    one_worker.deploy("busy", idle_timeout_s=300)
    one_worker.deploy("patient", idle_timeout_s=300)
    stop = threading.Event()
    statuses: list[int] = []

    def hammer(max_tokens: int) -> None:  # back-to-back requests: "busy" never goes idle
        while not stop.is_set():
            statuses.append(complete(one_worker, "busy", max_tokens=max_tokens).status_code)

    # Two overlapping hammers: with one, the moment between its requests leaves "busy" idle
    # for a few milliseconds, and a plain LRU eviction (not the preemption tested here) can
    # land in it. Their lengths differ: batched together, two requests of one length finish
    # on the same engine step, and both hammers would sit between requests at once.
    threads = [threading.Thread(target=hammer, args=(n,)) for n in (24, 37)]
    threads[0].start()
    one_worker.wait_for("busy to serve", lambda: bool(statuses), 60)
    threads[1].start()
    try:
        time.sleep(0.5)  # both in flight
        t0 = time.monotonic()
        r = complete(one_worker, "patient")
        waited = time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert r.status_code == 200, r.text
    assert waited < 60
    assert statuses and set(statuses) == {200}  # busy's requests queued meanwhile, none lost
    reasons = [e["reason"] for e in one_worker.scale_events("busy")]
    assert any(r.startswith("preempted for patient") for r in reasons), reasons


def test_queue_wait_past_the_timeout_is_503_with_retry_after(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    env = {
        "HOTPOOL_MAX_WORKERS": "1",
        "HOTPOOL_WARM_WORKERS": "0",
        "HOTPOOL_QUEUE_TIMEOUT_S": "2",
        "HOTPOOL_PREEMPT_AFTER_S": "600",
    }
    with running_server(tmp_path, f"file://{smollm2_snapshot_bf16}", env) as srv:
        srv.deploy("holder", idle_timeout_s=300)
        srv.deploy("waiter", idle_timeout_s=300)
        # Its own cold start takes longer than the 2s queue timeout: the first requests
        # are 503s, but the cold start goes on and a later request finds it ready.
        srv.wait_for("holder ready", lambda: complete(srv, "holder").status_code == 200)
        # Long enough to hold the only worker past the queue timeout on a slow machine; cut
        # short once the waiter has its answer.
        done = threading.Event()
        long = threading.Thread(target=lambda: stream(srv, "holder", 300, stop=done))
        long.start()
        try:
            srv.wait_for("holder busy", lambda: srv.replicas("holder")[0]["inflight"] == 1, 10)
            t0 = time.monotonic()
            r = complete(srv, "waiter")
            took = time.monotonic() - t0
        finally:
            done.set()
            long.join()
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "queue_timeout"
        assert int(r.headers["retry-after"]) > 0
        assert 2 <= took < 3
        # The waiter's place in the worker queue is withdrawn: nothing waits forever.
        srv.wait_for("no queued replica", lambda: not srv.replicas("waiter"), 5)
