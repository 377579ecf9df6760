"""The pool's worker slots and the autoscaler's decisions, in one event loop.

Worker processes are stood in for by a backend that "starts" a worker by registering it at
once, and the worker's HTTP API (/load, /unload) by an httpx mock transport: these tests
check bookkeeping (who gets which slot, when, and why) in milliseconds. The same behaviour
runs with real processes in tests/e2e/test_autoscale.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest

from hotpool.billing.deployments import DeploymentSpec
from hotpool.pool.autoscaler import Autoscaler
from hotpool.pool.backend import WorkerBackend, WorkerHandle
from hotpool.pool.pool import ScaleEvent, WorkerPool
from hotpool.pool.registry import WorkerRegistry
from hotpool.pool.replica import Replica, ReplicaState
from hotpool.worker.protocol import LoadRequest, LoadResult, WorkerInfo


class InstantBackend(WorkerBackend):
    """Workers that register the moment they start; ``kill`` makes one exit."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.running: set[str] = set()
        self.exited: dict[str, str] = {}
        self.started = 0

    async def start(self, worker_id: str) -> WorkerHandle:
        self.started += 1
        self.running.add(worker_id)
        info = WorkerInfo(worker_id, f"http://{worker_id}.test", 1000 + self.started, "cpu", 1)
        asyncio.get_running_loop().call_soon(self.registry.register, info)
        return WorkerHandle(worker_id, info.pid)

    async def stop(self, handle: WorkerHandle, grace_s: float = 10.0) -> None:
        self.running.discard(handle.worker_id)

    def exit_reason(self, handle: WorkerHandle) -> str | None:
        if handle.worker_id in self.exited:
            return self.exited[handle.worker_id]
        return None if handle.worker_id in self.running else "stopped"

    def kill(self, worker_id: str) -> None:
        self.running.discard(worker_id)
        self.exited[worker_id] = "worker process exited with code -9"


def _worker_api(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/load":
        body: dict[str, Any] = LoadResult("d", "sha", True, {"load": 0.0}, "disk").to_json()
        return httpx.Response(200, json=body)
    return httpx.Response(200, json={"status": "unloaded"})


def _spec(name: str, **kw: Any) -> DeploymentSpec:
    return DeploymentSpec(name=name, snapshot_uri=f"file:///s/{name}", **kw)


def _pool(
    max_workers: int, warm: int = 0, **kw: Any
) -> tuple[WorkerPool, InstantBackend, list[ScaleEvent]]:
    registry = WorkerRegistry()
    backend = InstantBackend(registry)
    events: list[ScaleEvent] = []
    pool = WorkerPool(
        backend, registry, "t", max_workers, 5.0, warm_workers=warm, on_scale=events.append, **kw
    )
    pool.launcher.client = httpx.AsyncClient(transport=httpx.MockTransport(_worker_api))
    return pool, backend, events


async def _ready(replica: Replica) -> Replica:
    await asyncio.wait_for(replica.ready.wait(), 5)
    assert replica.error is None, replica.error
    assert replica.state is ReplicaState.READY
    return replica


async def _settle(pool: WorkerPool) -> None:
    for _ in range(50):
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_a_replica_loads_its_deployments_snapshot_with_its_engine_options() -> None:
    async def scenario() -> None:
        pool, _, _ = _pool(max_workers=1)
        asked: list[dict[str, Any]] = []

        def worker_api(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/load":
                asked.append(json.loads(request.content))
            return _worker_api(request)

        pool.launcher.client = httpx.AsyncClient(transport=httpx.MockTransport(worker_api))
        spec = _spec("d", dtype="fp16", quantization="int8", max_model_len=512)
        await _ready(pool.scale_up(spec))
        # What the worker's /load reads back: every engine option, quantization included.
        assert [LoadRequest(**body) for body in asked] == [
            LoadRequest("d", "file:///s/d", "fp16", 512, None, quantization="int8")
        ]
        await pool.shutdown()

    run(scenario)


def test_slots_go_first_come_first_served_and_idle_replicas_are_evicted_lru() -> None:
    async def scenario() -> None:
        pool, backend, events = _pool(max_workers=2)  # and no idle workers kept
        a = await _ready(pool.scale_up(_spec("a")))
        b = await _ready(pool.scale_up(_spec("b")))
        a.last_used, b.last_used = 1.0, 2.0  # a is the least recently used
        c = pool.scale_up(_spec("c"))
        d = pool.scale_up(_spec("d"))
        await _settle(pool)
        await _ready(c)
        await _ready(d)
        evicted = [(e.deployment, e.reason) for e in events if "evicted" in e.reason]
        assert evicted == [
            ("a", "evicted (least recently used) for c"),  # the LRU one went first
            ("b", "evicted (least recently used) for d"),  # then the next in line got b's
        ]
        assert {r.deployment for r in pool.replicas()} == {"c", "d"}
        # Each evicted worker was unloaded and handed to the waiting cold start: the models
        # swapped in the same processes, none was stopped and none started.
        assert (c.handle.worker_id, d.handle.worker_id) == (a.handle.worker_id, b.handle.worker_id)
        assert backend.started == 2 and len(backend.running) == 2
        assert c.load is not None and c.load.phases["start"] < 0.5
        await pool.shutdown()

    run(scenario)


def test_busy_replicas_are_preempted_only_after_the_wait_and_never_below_min() -> None:
    async def scenario() -> None:
        pool, _, events = _pool(max_workers=2, preempt_after_s=0.3)
        floor = await _ready(pool.scale_up(_spec("floor", min_replicas=1)))
        busy = await _ready(pool.scale_up(_spec("busy")))
        floor.inflight = busy.inflight = 1
        waiting = pool.scale_up(_spec("waiting"))
        await asyncio.sleep(0.15)
        assert waiting.state is ReplicaState.QUEUED and busy.state is ReplicaState.READY
        await asyncio.sleep(0.3)
        pool._grant()  # what the autoscaler's tick does every second
        await _settle(pool)
        assert busy.state is ReplicaState.DRAINING  # takes no new requests, finishes its own
        assert floor.state is ReplicaState.READY  # min_replicas is never preempted
        busy.inflight = 0  # its last request finished
        await _ready(waiting)
        assert any(e.reason.startswith("preempted for waiting") for e in events)
        await pool.shutdown()

    run(scenario)


def test_queued_replica_can_be_withdrawn_and_frees_its_place() -> None:
    async def scenario() -> None:
        pool, _, _ = _pool(max_workers=1, preempt_after_s=60)
        held = await _ready(pool.scale_up(_spec("held")))
        held.inflight = 1
        queued = pool.scale_up(_spec("q"))
        await _settle(pool)
        assert queued.state is ReplicaState.QUEUED
        assert pool.cancel(queued, "no demand")
        await asyncio.wait_for(queued.ready.wait(), 1)
        assert queued.error == "no demand" and pool.replicas("q") == []
        assert not pool.cancel(held, "busy replicas are not withdrawn")
        await pool.shutdown()

    run(scenario)


def test_dead_and_silent_workers_are_replaced_when_still_wanted() -> None:
    async def scenario() -> None:
        pool, backend, events = _pool(max_workers=3, heartbeat_timeout_s=0.2)
        spec = _spec("d", idle_timeout_s=60)
        first = await _ready(pool.scale_up(spec))
        backend.kill(first.handle.worker_id)
        assert [r.id for r in pool.reap_dead()] == [first.id]
        (replacement,) = pool.replicas("d")
        assert replacement.replacement and "worker died" in events[-2].reason
        await _ready(replacement)

        # Registered but silent (hung, SIGSTOPped): dead once the heartbeat timeout passes.
        registered = pool.registry.get(replacement.handle.worker_id)
        assert registered is not None
        registered.last_seen = time.monotonic() - 1.0
        (silent,) = pool.reap_dead()
        assert silent is replacement and "no heartbeat" in (silent.error or "")
        await _ready(pool.replicas("d")[0])

        # Idle past its timeout when it died: not replaced (the next request cold-starts).
        idle_spec = _spec("idle", idle_timeout_s=0.01)
        idle = await _ready(pool.scale_up(idle_spec))
        idle.last_used = time.monotonic() - 1.0
        backend.kill(idle.handle.worker_id)
        pool.reap_dead()
        assert pool.replicas("idle") == []
        await pool.shutdown()

    run(scenario)


def test_a_load_longer_than_the_heartbeat_timeout_is_not_a_death() -> None:
    """A worker busy loading may miss its heartbeats (a big model, a loaded machine): the
    load's answer shows it alive, so the replica is not reaped the moment it is ready."""

    async def scenario() -> None:
        pool, _, events = _pool(max_workers=1, heartbeat_timeout_s=0.2)
        loading = asyncio.Event()

        async def slow_load(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/load":
                loading.set()
                await asyncio.sleep(0.5)  # no heartbeat arrives meanwhile
            return _worker_api(request)

        pool.launcher.client = httpx.AsyncClient(transport=httpx.MockTransport(slow_load))
        replica = pool.scale_up(_spec("d", idle_timeout_s=60))
        await loading.wait()
        assert pool.reap_dead() == []  # silent, but still loading: a cold start is not reaped
        await _ready(replica)
        silent = pool.registry.silent_for(replica.handle.worker_id)
        assert silent is not None and silent < 0.2
        assert pool.reap_dead() == [] and replica.state is ReplicaState.READY
        assert not any("worker died" in e.reason for e in events)
        # Silence after that is death again, as before.
        registered = pool.registry.get(replica.handle.worker_id)
        assert registered is not None
        registered.last_seen = time.monotonic() - 1.0
        assert pool.reap_dead() == [replica]
        await pool.shutdown()

    run(scenario)


def test_while_the_server_stops_silence_is_not_death_but_an_exit_still_is() -> None:
    async def scenario() -> None:
        pool, backend, events = _pool(max_workers=3, heartbeat_timeout_s=0.2)
        specs = {"d": _spec("d", min_replicas=2, max_replicas=2, idle_timeout_s=60)}
        scaler = _scaler(pool, specs, {}, window=60)
        await scaler.tick()
        streaming, other = [await _ready(r) for r in pool.replicas("d")]
        streaming.inflight = 1
        pool.begin_shutdown()  # uvicorn closes its listeners: heartbeats can no longer arrive
        for r in (streaming, other):
            registered = pool.registry.get(r.handle.worker_id)
            assert registered is not None
            registered.last_seen = time.monotonic() - 10.0
        assert pool.reap_dead() == []  # its stream goes on
        assert streaming.state is ReplicaState.READY
        backend.kill(other.handle.worker_id)
        assert pool.reap_dead() == [other]  # a process that ended is still found ...
        await scaler.tick()
        assert pool.replicas("d") == [streaming]  # ... and not replaced, even below the floor
        assert not any(e.reason == "replacing a dead worker" for e in events)
        streaming.inflight = 0
        await pool.shutdown()

    run(scenario)


def test_worker_failed_tells_dead_from_alive() -> None:
    async def scenario() -> None:
        pool, backend, _ = _pool(max_workers=2)
        r = await _ready(pool.scale_up(_spec("d")))
        assert await pool.worker_failed(r, settle_s=0.05) is False  # a glitch, still running
        backend.kill(r.handle.worker_id)
        assert await pool.worker_failed(r, settle_s=0.05) is True
        assert r not in pool.replicas("d")
        await pool.shutdown()

    run(scenario)


def _scaler(
    pool: WorkerPool, specs: dict[str, DeploymentSpec], queued: dict[str, int], window: float
) -> Autoscaler:
    return Autoscaler(
        pool, lambda: specs, lambda n, v: queued.get(n, 0), scale_down_window_s=window
    )


def test_autoscaler_scales_on_load_at_once_and_down_only_after_the_window() -> None:
    async def scenario() -> None:
        pool, _, events = _pool(max_workers=4)
        spec = _spec("d", max_replicas=3, target_concurrency=2, idle_timeout_s=60)
        queued = {"d": 1}
        scaler = _scaler(pool, {"d": spec}, queued, window=0.3)
        await scaler.tick()
        (first,) = pool.replicas("d")
        await _ready(first)
        queued["d"] = 0
        first.inflight = 5  # ceil(5 / 2) = 3 replicas wanted
        await scaler.tick()
        assert len(pool.replicas("d")) == 3
        assert events[-1].reason == "load 5 > 1 x target_concurrency 2"
        for r in pool.replicas("d"):
            await _ready(r)
        first.inflight = 0
        await scaler.tick()
        assert len(pool.replicas("d")) == 3  # within the window: no flapping
        await asyncio.sleep(0.35)
        await scaler.tick()
        await _settle(pool)
        # Down to one (the idle timeout, not the window, takes the last one to zero).
        assert len([r for r in pool.replicas("d") if r.state is ReplicaState.READY]) == 1
        assert len([e for e in events if e.to_replicas > e.from_replicas]) == 3
        await pool.shutdown()

    run(scenario)


def test_autoscaler_keeps_min_replicas_and_scales_to_zero_after_idle_timeout() -> None:
    async def scenario() -> None:
        pool, _, events = _pool(max_workers=3)
        specs = {"kept": _spec("kept", min_replicas=1, idle_timeout_s=0.05),
                 "gone": _spec("gone", idle_timeout_s=0.05)}  # fmt: skip
        scaler = _scaler(pool, specs, {}, window=0.0)
        await scaler.tick()
        (kept,) = pool.replicas("kept")
        assert events[-1].reason == "min_replicas=1"
        gone = await _ready(pool.scale_up(specs["gone"]))
        await _ready(kept)
        await asyncio.sleep(0.1)
        await scaler.tick()
        await _settle(pool)
        assert pool.replicas("gone") == [] and gone.state is ReplicaState.DRAINING
        assert pool.replicas("kept") == [kept]
        assert any(e.deployment == "gone" and e.reason == "idle timeout" for e in events)
        await pool.shutdown()

    run(scenario)


def test_an_idle_replica_the_load_still_needs_outlives_its_idle_timeout() -> None:
    """Streams that queued for a cold deployment all go to the first replica ready; the
    second, ready a moment later, serves nothing, but the load wants it: no idle timeout
    (scaling it down only for the next tick to ask for it again)."""

    async def scenario() -> None:
        pool, _, events = _pool(max_workers=2)
        spec = _spec("d", max_replicas=2, target_concurrency=2, idle_timeout_s=0.05)
        scaler = _scaler(pool, {"d": spec}, {}, window=0.0)
        busy = await _ready(pool.scale_up(spec))
        spare = await _ready(pool.scale_up(spec))
        busy.inflight = 4  # ceil(4 / 2) = 2 replicas wanted
        await asyncio.sleep(0.1)
        await scaler.tick()
        await _settle(pool)
        assert pool.replicas("d") == [busy, spare] and spare.state is ReplicaState.READY
        busy.inflight = 1  # now one replica is enough: the idle one goes
        await scaler.tick()
        await _settle(pool)
        assert pool.replicas("d") == [busy]
        assert [e.reason for e in events if e.to_replicas < e.from_replicas] == ["idle timeout"]
        await pool.shutdown()

    run(scenario)


def test_autoscaler_withdraws_queued_replicas_nobody_waits_for_any_more() -> None:
    async def scenario() -> None:
        pool, _, _ = _pool(max_workers=1, preempt_after_s=60)
        held = await _ready(pool.scale_up(_spec("held")))
        held.inflight = 1
        queued = {"q": 1}
        specs = {"held": _spec("held"), "q": _spec("q")}
        scaler = _scaler(pool, specs, queued, window=0.0)
        await scaler.tick()
        (waiting,) = pool.replicas("q")
        await _settle(pool)
        assert waiting.state is ReplicaState.QUEUED
        queued["q"] = 0  # its only request timed out
        await scaler.tick()
        assert pool.replicas("q") == [] and waiting.error is not None
        await pool.shutdown()

    run(scenario)


@pytest.mark.parametrize("warm", [0, 1])
def test_workers_by_state_counts_every_process(warm: int) -> None:
    async def scenario() -> None:
        pool, backend, _ = _pool(max_workers=2, warm=warm)
        pool.start()
        await _settle(pool)
        r = await _ready(pool.scale_up(_spec("d")))
        await _settle(pool)
        counts = pool.workers_by_state()
        assert counts["serving"] == 1 and counts["idle"] == warm
        assert sum(counts.values()) == len(backend.running)
        r.inflight = 0
        await pool.shutdown()
        assert backend.running == set()

    run(scenario)


def test_a_new_generation_rolls_over_without_a_gap() -> None:
    async def scenario() -> None:
        pool, _, events = _pool(max_workers=3)
        v1 = _spec("d", max_replicas=2, idle_timeout_s=60)
        specs = {"d": v1}
        scaler = _scaler(pool, specs, {}, window=60)
        old = await _ready(pool.scale_up(v1))
        old.inflight = 1  # a stream in flight on the old snapshot
        specs["d"] = replace(v1, snapshot_uri="file:///s/d-v2", generation=2)
        await scaler.tick()
        new = next(r for r in pool.replicas("d") if r is not old)
        assert new.generation == 2 and events[-1].reason == "rolling over to version 2"
        assert old.state is ReplicaState.READY  # serves until the new one is ready
        await _ready(new)
        await scaler.tick()
        await _settle(pool)
        assert old.state is ReplicaState.DRAINING  # no new requests; its stream finishes
        old.inflight = 0
        await _settle(pool)
        await asyncio.sleep(0.1)
        assert pool.replicas("d") == [new]
        assert any(e.reason == "rolled over to version 2" for e in events)
        await pool.shutdown()

    run(scenario)


def test_a_deleted_deployments_replicas_never_serve_a_new_one_of_the_same_name() -> None:
    async def scenario() -> None:
        pool, backend, events = _pool(max_workers=3)
        specs = {"d": _spec("d", tenant_id=1)}
        scaler = _scaler(pool, specs, {}, window=60)
        busy = await _ready(pool.scale_up(specs["d"]))
        busy.inflight = 1  # a stream of the old deployment still runs
        starting = pool.scale_up(specs["d"])  # and a cold start is under way
        del specs["d"]
        pool.retire("d")
        assert pool.replicas("d") == [] and pool.replicas() == []
        assert busy.state is ReplicaState.DRAINING  # its stream finishes; nothing new
        await asyncio.wait_for(starting.ready.wait(), 5)
        assert starting.error == "deployment deleted"
        # Another tenant takes the name at once: its replicas are its own, from scratch.
        specs["d"] = _spec("d", tenant_id=2, max_model_len=600)
        await scaler.tick()
        assert pool.replicas("d") == []  # no demand yet: nothing borrowed either
        mine = await _ready(pool.scale_up(specs["d"]))
        assert pool.replicas("d") == [mine] and mine is not busy
        assert pool.workers_by_state()["draining"] == 1  # the old one is still a process
        busy.inflight = 0
        for _ in range(50):
            await _settle(pool)
            if busy.handle.worker_id not in backend.running:
                break
        assert busy.handle.worker_id not in backend.running
        assert pool.replicas("d") == [mine]
        # the new deployment's history has no event of the old one's replicas
        assert not any(e.replica_id in (busy.id, starting.id) and e.to_replicas < e.from_replicas
                       and e.reason == "deployment deleted" for e in events)  # fmt: skip
        await pool.shutdown()

    run(scenario)


def test_a_roll_over_on_a_full_pool_drains_the_old_version_to_make_room() -> None:
    async def scenario() -> None:
        pool, _, events = _pool(max_workers=1, preempt_after_s=3600)
        v1 = _spec("d", max_replicas=1, idle_timeout_s=60)
        specs = {"d": v1}
        scaler = _scaler(pool, specs, {"d": 1}, window=60)
        old = await _ready(pool.scale_up(v1))
        old.inflight = 1  # a stream in flight on the old version, on the only worker
        specs["d"] = replace(v1, snapshot_uri="file:///s/d-v2", generation=2)
        await scaler.tick()
        await _settle(pool)
        new = next(r for r in pool.replicas("d") if r is not old)
        # No worker is free for both: the old version drains (its stream finishes, new
        # requests queue for the new one) instead of holding the worker for ever.
        assert old.state is ReplicaState.DRAINING and new.state is ReplicaState.QUEUED
        old.inflight = 0
        await _ready(new)
        assert pool.replicas("d") == [new]
        assert any(e.reason == "rolled over to version 2" for e in events)
        # The queue did not stall behind it: another deployment still gets the worker.
        other = pool.scale_up(_spec("e"))
        await _ready(other)
        assert new.id not in {r.id for r in pool.replicas()}
        await pool.shutdown()

    run(scenario)


def test_a_canary_and_its_stable_version_take_turns_on_a_full_pool() -> None:
    """One worker: a canary request must not wait for ever beside an idle stable replica
    (only other deployments were evicted); a busy one is preempted after the wait."""

    async def scenario() -> None:
        pool, _, events = _pool(max_workers=1, preempt_after_s=0.3)
        stable = _spec("d", max_replicas=1, idle_timeout_s=60)
        canary = replace(stable, snapshot_uri="file:///s/d-v2", generation=2)
        pool.scale_up(stable)
        old = await _ready(pool.replicas("d")[0])
        new = await _ready(pool.scale_up(canary, canary=True))
        assert old.state is not ReplicaState.READY and pool.replicas("d") == [new]
        assert any(e.reason == "evicted (least recently used) for d version 2" for e in events)
        new.inflight = 1  # now the stable version waits behind a busy canary
        back = pool.scale_up(stable)
        await asyncio.sleep(0.4)
        pool._grant()  # the autoscaler's tick
        await _settle(pool)
        assert new.state is ReplicaState.DRAINING
        new.inflight = 0
        await _ready(back)
        assert any(e.reason.startswith("preempted for d version 1") for e in events)
        await pool.shutdown()

    run(scenario)


def test_a_roll_over_on_a_full_pool_replaces_old_replicas_one_at_a_time() -> None:
    async def scenario() -> None:
        pool, _, _ = _pool(max_workers=2, preempt_after_s=3600)
        v1 = _spec("d", min_replicas=2, max_replicas=2, idle_timeout_s=60)
        specs = {"d": v1}
        scaler = _scaler(pool, specs, {}, window=60)
        await scaler.tick()
        olds = [await _ready(r) for r in pool.replicas("d")]
        assert len(olds) == 2
        gate = asyncio.Event()  # holds the new version's first load
        real_load = pool.launcher.load

        async def slow_load(worker: WorkerInfo, spec: DeploymentSpec) -> LoadResult:
            await gate.wait()
            return await real_load(worker, spec)

        pool.launcher.load = slow_load  # type: ignore[method-assign]
        specs["d"] = replace(v1, snapshot_uri="file:///s/d-v2", generation=2)
        await scaler.tick()
        await _settle(pool)
        states = Counter((r.generation, r.state) for r in pool.replicas("d"))
        # one old replica gave its worker to the first new one; the other serves on
        assert states == {(1, ReplicaState.READY): 1, (2, ReplicaState.LOADING): 1,
                          (2, ReplicaState.QUEUED): 1}  # fmt: skip
        gate.set()
        for _ in range(100):
            await scaler.tick()
            await _settle(pool)
            if {(r.generation, r.state) for r in pool.replicas("d")} == {(2, ReplicaState.READY)}:
                break
        assert [r.generation for r in pool.replicas("d")] == [2, 2]
        assert all(r.state is ReplicaState.READY for r in pool.replicas("d"))
        await pool.shutdown()

    run(scenario)


def test_a_canary_scales_on_its_own_load_and_to_zero_while_stable_keeps_its_floor() -> None:
    async def scenario() -> None:
        pool, _, events = _pool(max_workers=4)
        stable = _spec("d", min_replicas=1, max_replicas=2, target_concurrency=1,
                       idle_timeout_s=0.2)  # fmt: skip
        stable = replace(stable, canary_version=2, canary_percent=20.0)
        canary = replace(stable, generation=2, canary_version=None, canary_percent=None)
        queued: dict[tuple[str, int], int] = {("d", 2): 2}  # two requests wait for the canary
        scaler = Autoscaler(
            pool,
            lambda: {"d": stable},
            lambda n, v: queued.get((n, v), 0),
            scale_down_window_s=0.1,
            canary_of=lambda spec: canary,
        )
        await scaler.tick()
        by_version = Counter(r.generation for r in pool.replicas("d"))
        assert by_version == {1: 1, 2: 2}  # the floor for stable, the load for the canary
        for r in pool.replicas("d"):
            await _ready(r)
        queued.clear()
        for r in pool.replicas("d"):
            r.last_used = time.monotonic() - 1.0
        await asyncio.sleep(0.15)
        await scaler.tick()
        await _settle(pool)
        live = [r for r in pool.replicas("d") if r.state is ReplicaState.READY]
        assert [r.generation for r in live] == [1]  # the canary went to zero, stable did not
        assert any(e.reason == "idle timeout" for e in events)
        await pool.shutdown()

    run(scenario)
