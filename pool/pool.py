"""The worker pool: turns workers into replicas of deployments and back.

A cold start runs in the background: wait for a worker slot (first come first served within
``max_workers``), claim an idle worker or start a worker process and wait for it to
register, then ask it to load the deployment's snapshot. Callers wait on the replica's
``ready`` event, so requests queue through a cold start instead of failing. Releasing a
replica drains it (no new requests, in-flight ones finish), unloads its model and returns
the worker to the first cold start waiting for a slot, else to the idle set
(``warm_workers`` of them, refilled in the background), or stops it when the idle set is
full. A worker that dies or stops heartbeating is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import httpx

from hotpool.billing.deployments import DeploymentSpec
from hotpool.pool.backend import WorkerBackend, WorkerHandle
from hotpool.pool.launcher import WorkerLauncher
from hotpool.pool.registry import WorkerRegistry
from hotpool.pool.replica import Replica, ReplicaState
from hotpool.pool.warm import IdleWorker, WarmPool
from hotpool.worker.protocol import WorkerInfo

log = logging.getLogger("hotpool.pool")


@dataclass(frozen=True)
class ScaleEvent:
    deployment: str
    from_replicas: int
    to_replicas: int
    reason: str
    replica_id: str | None = None  # the replica added or removed


_START = object()  # a granted slot with no idle worker to claim: start a process


class WorkerPool:
    def __init__(
        self,
        backend: WorkerBackend,
        registry: WorkerRegistry,
        worker_token: str,
        max_workers: int,
        start_timeout_s: float,
        warm_workers: int = 0,
        heartbeat_timeout_s: float = 15.0,
        preempt_after_s: float = 10.0,
        on_scale: Callable[[ScaleEvent], None] | None = None,
        on_ready: Callable[[Replica], None] | None = None,
    ) -> None:
        self.backend = backend
        self.registry = registry
        self.launcher = WorkerLauncher(
            backend, registry, worker_token, start_timeout_s, lambda: self._closing
        )
        self.max_workers = max_workers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.preempt_after_s = preempt_after_s
        self.on_scale = on_scale or (lambda e: None)
        self.on_ready = on_ready or (lambda r: None)
        self._replicas: dict[str, Replica] = {}
        self._specs: dict[str, DeploymentSpec] = {}  # last spec each deployment scaled with
        self._canaries: dict[str, DeploymentSpec] = {}  # the canary version's, while one runs
        self._tasks: set[asyncio.Task[None]] = set()
        self._cold_starts: dict[str, asyncio.Task[None]] = {}
        # Replicas waiting for a worker slot, first come first served.
        self._slot_queue: deque[tuple[Replica, asyncio.Future[object]]] = deque()
        self._evicting = 0  # releases under way to make room for the queue's head
        self.warm = WarmPool(
            min(warm_workers, max_workers),
            self.launcher.start,
            self.launcher.stop,
            room=lambda: not self._slot_queue and self._processes() < self.max_workers,
            on_idle=self._grant,
        )
        self._unloading = 0  # released workers between replica and idle (still processes)
        self._closing = False

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client that talks to workers (the invoker streams through it too)."""
        return self.launcher.client

    def replica_on(self, worker_id: str) -> Replica | None:
        """The replica whose worker is ``worker_id``, if it has one now."""
        for r in self._replicas.values():
            if r.handle.worker_id == worker_id:
                return r
        return None

    def replicas(self, deployment: str | None = None) -> list[Replica]:
        """The replicas of ``deployment`` (None: of every deployment) as it exists now:
        never those of a deleted one of the same name, which drain out of sight."""
        return [
            r
            for r in self._replicas.values()
            if deployment in (None, r.deployment) and not r.retired
        ]

    def idle_workers(self) -> list[IdleWorker]:
        return self.warm.idle.all()

    def workers_by_state(self) -> dict[str, int]:
        """Worker processes (and slots being waited for) by what they are doing."""
        counts = {s: 0 for s in ("starting", "idle", "loading", "serving", "draining")}
        counts["idle"] = len(self.warm.idle)
        counts["starting"] = len(self.warm) - len(self.warm.idle) + self._unloading
        for r in self._replicas.values():  # retired ones are processes too
            if r.state is ReplicaState.COLD:
                counts["starting"] += 1
            elif r.state is ReplicaState.LOADING:
                counts["loading"] += 1
            elif r.state is ReplicaState.READY:
                counts["serving"] += 1
            elif r.state is ReplicaState.DRAINING:
                counts["draining"] += 1
        return counts

    def start(self) -> None:
        """Begin filling the idle set (call once the event loop runs)."""
        self.warm.refill()

    def scale_up(
        self, spec: DeploymentSpec, reason: str = "request", canary: bool = False
    ) -> Replica:
        """Add a replica of ``spec``; returns at once (await its ``ready`` event).

        It starts QUEUED and takes the first worker slot that frees up, first come first
        served: an idle worker, room for a new process, or a worker made free by evicting
        the least-recently-used idle replica of another deployment (or, once it has waited
        ``preempt_after_s``, by draining a busy one, so no deployment starves).
        ``canary``: ``spec`` is the deployment's canary version, not its stable one."""
        if canary:
            self._canaries[spec.name] = spec
        else:
            self._specs[spec.name] = spec
        before = len(self.replicas(spec.name))
        replica = Replica(
            id=f"r-{uuid.uuid4().hex[:12]}",
            deployment=spec.name,
            handle=WorkerHandle(f"w-{uuid.uuid4().hex[:12]}"),
            generation=spec.generation,
        )
        self._replicas[replica.id] = replica
        self.on_scale(ScaleEvent(spec.name, before, before + 1, reason, replica.id))
        task = self._spawn(self._cold_start(replica, spec))
        self._cold_starts[replica.id] = task
        task.add_done_callback(lambda _: self._cold_starts.pop(replica.id, None))
        return replica

    def remember(self, spec: DeploymentSpec, canary: DeploymentSpec | None = None) -> None:
        """The deployment's current spec (after an update) and its canary version's, if one
        runs: floors and replacements use them."""
        self._specs[spec.name] = spec
        if canary is None:
            self._canaries.pop(spec.name, None)
        else:
            self._canaries[spec.name] = canary

    def cancel(self, replica: Replica, reason: str) -> bool:
        """Withdraw a replica still waiting for a worker slot (its demand went away)."""
        if replica.state is not ReplicaState.QUEUED:
            return False
        task = self._cold_starts.get(replica.id)
        if task is not None:
            task.cancel()
        replica.error = reason
        self._forget(replica, reason)
        replica.ready.set()
        return True

    def _processes(self) -> int:
        held = sum(1 for r in self._replicas.values() if r.holds_worker)
        return held + len(self.warm) + self._unloading

    def retire(self, deployment: str, reason: str = "deployment deleted") -> None:
        """``deployment`` was deleted: from now on none of its replicas takes a request or
        shows under its name, which a new deployment (another tenant's too) may take at
        once. Replicas waiting for a worker are withdrawn, cold starts stopped (requests
        waiting on them learn why), the others drain (their requests finish) and go."""
        self._specs.pop(deployment, None)
        self._canaries.pop(deployment, None)
        for r in self.replicas(deployment):
            r.retired = True
            task = self._cold_starts.get(r.id)
            if self.cancel(r, reason):
                self.on_ready(r)  # a retired replica has no scale-down event: this ends it
            elif task is not None and not task.done():
                r.error = r.error or reason
                task.cancel()  # it removes the replica, stops its worker and wakes waiters
                self.on_ready(r)
            else:
                self.release_soon(r, reason)

    def release_soon(self, replica: Replica, reason: str) -> None:
        """:meth:`release` in the background (the autoscaler must not wait for a drain); the
        replica is draining (takes no new request) when this returns."""
        if self._begin_release(replica, reason):
            self._spawn(self._drain(replica, reason, grace_s=30.0))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def release(self, replica: Replica, reason: str, grace_s: float = 30.0) -> None:
        """Drain ``replica`` (in-flight requests finish), then unload it and keep its worker
        idle (its model stays in the worker's host tier), or stop the worker."""
        if self._begin_release(replica, reason):
            await self._drain(replica, reason, grace_s)

    def _begin_release(self, replica: Replica, reason: str) -> bool:
        """Withdraw ``replica`` if it waits for a worker, else mark it draining; False when
        there is nothing (more) to drain."""
        if replica.id not in self._replicas or replica.state is ReplicaState.DRAINING:
            return False
        if self.cancel(replica, reason):
            return False
        replica.state = ReplicaState.DRAINING
        replica.prefixes.clear()  # no new request goes there: its prefixes steer nothing
        return True

    async def _drain(self, replica: Replica, reason: str, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while replica.inflight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110 (a counter)
            await asyncio.sleep(0.05)
        await self._remove(replica, reason, keep_warm=True)

    def begin_shutdown(self) -> None:
        """The server stops taking connections and drains its streams (the heartbeats'
        listener closes with the others): from now on a silent worker is not dead, as its
        heartbeats cannot arrive (only its process ending counts), and nothing is started
        or replaced."""
        self._closing = True

    @property
    def closing(self) -> bool:
        return self._closing

    async def shutdown(self) -> None:
        self._closing = True  # warm starts end on their own (no orphaned process)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(
            self.warm.close(), *(self._remove(r, "shutdown") for r in list(self._replicas.values()))
        )
        await self.launcher.close()

    # --- dead workers ---------------------------------------------------------------------

    def reap_dead(self) -> list[Replica]:
        """Replicas whose worker died (its process ended, or it missed heartbeats for
        ``heartbeat_timeout_s``): removed, their process stopped, and a replacement started
        unless they were draining anyway. Dead idle workers are dropped and replaced."""
        self.warm.reap(self.backend.exit_reason)
        dead = [r for r in self._replicas.values() if self._death(r)]
        for r in dead:
            self._lost(r)
        self._grant()
        return dead

    def _death(self, replica: Replica) -> str | None:
        if replica.state not in (ReplicaState.READY, ReplicaState.DRAINING):
            return None  # a cold start finds out by itself (its calls fail or time out)
        if why := self.backend.exit_reason(replica.handle):
            replica.error = why
            return why
        silent = self.registry.silent_for(replica.handle.worker_id)
        if silent is not None and silent > self.heartbeat_timeout_s and not self._closing:
            replica.error = f"no heartbeat for {silent:.0f}s"
            return replica.error
        return None

    async def worker_failed(self, replica: Replica, settle_s: float = 1.0) -> bool:
        """A call to ``replica`` failed at the transport level: True if its worker is dead
        (it is then handled like :meth:`reap_dead` does, at once), False if it still runs."""
        deadline = time.monotonic() + settle_s
        while True:
            if replica.id not in self._replicas:
                return True  # someone else already found it dead
            if self._death(replica):
                self._lost(replica)
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)  # a killed process takes a moment to be reaped

    def _lost(self, replica: Replica) -> None:
        was_draining = replica.state is ReplicaState.DRAINING
        log.warning("replica %s of %s lost: %s", replica.id, replica.deployment, replica.error)
        self._forget(replica, f"worker died: {replica.error}")
        self._spawn(self.launcher.stop(replica.handle, grace_s=0.0))  # a hung one holds memory
        spec = self._specs.get(replica.deployment)
        canary = self._canaries.get(replica.deployment)
        of_canary = canary is not None and replica.generation == canary.generation
        if of_canary:
            spec = canary  # a canary replica is replaced by one of the canary
        if spec is None or was_draining or self._closing:
            return
        # Replace it if the deployment would have kept it: in use, or not yet idle too long.
        recent = time.monotonic() - replica.last_used < spec.idle_timeout_s
        if replica.inflight > 0 or recent or len(self._live(spec.name)) < spec.min_replicas:
            replacement = self.scale_up(spec, reason="replacing a dead worker", canary=of_canary)
            replacement.replacement = True

    # --- worker slots ---------------------------------------------------------------------

    async def _slot(self, replica: Replica) -> object:
        """Wait for a worker slot: an :class:`IdleWorker`, a warm start in progress, or
        ``_START`` (room to start a process)."""
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._slot_queue.append((replica, fut))
        self._grant()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as we were cancelled: give back
                self._give_back(fut.result())
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._slot_queue.remove((replica, fut))

    def _give_back(self, source: object) -> None:
        if isinstance(source, IdleWorker):
            self.warm.offer(source)
        elif isinstance(source, asyncio.Task):
            source.add_done_callback(lambda t: self._idle_started(t))
        self._grant()

    def _idle_started(self, task: asyncio.Task[IdleWorker]) -> None:
        if not task.cancelled() and task.exception() is None:
            self.warm.offer(task.result())
            self._grant()

    def _grant(self) -> None:
        """Hand free worker slots to the queue in order; make room for its head if none."""
        while (replica := self._queue_head()) is not None:
            source: object | None = self.warm.claim(replica.deployment)
            if source is None and self._processes() < self.max_workers:
                source = _START
            if source is None:
                self._make_room(replica)
                return
            self._give_slot(source)
        self.warm.refill()

    def _queue_head(self) -> Replica | None:
        """The first replica still waiting for a slot (withdrawn ones are dropped)."""
        while self._slot_queue:
            replica, fut = self._slot_queue[0]
            if not fut.done():
                return replica
            self._slot_queue.popleft()
        return None

    def _give_slot(self, source: object) -> None:
        """``source`` to the queue's head (call :meth:`_queue_head` first)."""
        replica, fut = self._slot_queue.popleft()
        replica.state = ReplicaState.COLD  # holds its slot from now on
        fut.set_result(source)

    def _make_room(self, waiting: Replica) -> None:
        if self._evicting or self._closing:
            return  # one release at a time; when it ends, _grant runs again
        if (old := self._outdated_for(waiting)) is not None:
            self._evicting += 1
            self._spawn(self._evict(old, f"rolled over to version {waiting.generation}"))
            return
        served = self._versions(waiting.deployment)
        outdated = {r.generation for r in self.replicas(waiting.deployment)} - served
        # Another deployment's replicas, and the other served version's of this one: a
        # canary and its stable version on a full pool take turns as two deployments do
        # (a canary request waited for ever beside an idle stable replica).
        others = [
            r
            for r in self.replicas()
            if r.state is ReplicaState.READY
            and (
                r.deployment != waiting.deployment
                or r.generation not in (waiting.generation, *outdated)  # those: _outdated_for
            )
            and len(self._live(r.deployment)) > self._floor(r.deployment)
        ]
        idle = [r for r in others if r.inflight == 0]
        waited = time.monotonic() - waiting.requested_at
        if idle:
            victim = min(idle, key=lambda r: r.last_used)  # least recently used
            reason = f"evicted (least recently used) for {_version_of(waiting, victim)}"
        elif others and waited >= self.preempt_after_s:
            # Busy everywhere: take turns. The deployment holding the most workers gives
            # one up first; its in-flight requests finish (drain), new ones queue.
            victim = max(others, key=lambda r: (len(self._live(r.deployment)), -r.requested_at))
            reason = f"preempted for {_version_of(waiting, victim)} (waited {waited:.0f}s)"
        else:
            return
        self._evicting += 1
        self._spawn(self._evict(victim, reason))

    def _outdated_for(self, waiting: Replica) -> Replica | None:
        """A roll-over with no free worker for the new version beside the old: a ready
        replica of ``waiting``'s deployment that runs a version no longer served (neither
        the stable one nor the canary), which then drains (its requests finish; new ones
        queue for the new version) and hands its worker over. Without this the new version
        never got a worker (the old held it, and only other deployments are evicted), and
        the queue behind it stalled. One at a time: not while a replica of the deployment
        is starting, so where the pool has several old replicas the others serve on until
        the new one is ready (then the autoscaler drains them all)."""
        versions = self._versions(waiting.deployment)
        mine = self.replicas(waiting.deployment)
        if waiting.generation not in versions or any(
            r.state in (ReplicaState.COLD, ReplicaState.LOADING) for r in mine
        ):
            return None
        old = [r for r in mine if r.state is ReplicaState.READY and r.generation not in versions]
        return min(old, key=lambda r: (r.inflight, r.last_used), default=None)

    def _versions(self, deployment: str) -> set[int]:
        """The versions of ``deployment`` that serve now: the stable one and the canary."""
        spec, canary = self._specs.get(deployment), self._canaries.get(deployment)
        return {s.generation for s in (spec, canary) if s is not None}

    async def _evict(self, victim: Replica, reason: str) -> None:
        try:
            await self.release(victim, reason)
        finally:
            self._evicting -= 1
            self._grant()

    def _live(self, deployment: str) -> list[Replica]:
        return [r for r in self.replicas(deployment) if r.state is not ReplicaState.DRAINING]

    def _floor(self, deployment: str) -> int:
        spec = self._specs.get(deployment)
        return spec.min_replicas if spec else 0

    async def _cold_start(self, replica: Replica, spec: DeploymentSpec) -> None:
        """Get a worker, load the snapshot. Phases (seconds): ``queue`` (waiting for a worker
        slot), ``start`` (claiming an idle worker, or process start to registration), then
        the worker's ``fetch``, ``load`` and ``warmup``."""
        try:
            source = await self._slot(replica)
            t0 = time.monotonic()
            if isinstance(source, IdleWorker):
                worker: IdleWorker | None = source
            elif isinstance(source, asyncio.Task):
                worker = await source
            else:
                worker = None
            if worker is not None:
                replica.handle, replica.worker = worker.handle, worker.info
            else:
                replica.handle, replica.worker = await self.launcher.start(replica.handle.worker_id)
            t1 = time.monotonic()
            replica.state = ReplicaState.LOADING
            load = await self.launcher.load(replica.worker, spec)
            # Its answer is a sign of life: the load's silence must not count against it
            # at the next reap (a heartbeat sent during the load can arrive after it).
            self.registry.seen(replica.handle.worker_id)
            phases = {"queue": t0 - replica.requested_at, "start": t1 - t0, **load.phases}
            replica.load = replace(load, phases=phases)
            replica.cold_start_seconds = time.monotonic() - replica.requested_at
            replica.last_used = time.monotonic()
            replica.state = ReplicaState.READY
            self.on_ready(replica)
            log.info(
                "replica %s of %s ready in %.2fs %s",
                replica.id, spec.name, replica.cold_start_seconds, replica.load.phases,
            )  # fmt: skip
        except asyncio.CancelledError:
            replica.error = replica.error or "cancelled"
            await asyncio.shield(self._remove(replica, replica.error))
            raise
        except Exception as exc:
            replica.error = str(exc) or type(exc).__name__
            log.error("cold start of %s failed: %s", spec.name, replica.error)
            self.on_ready(replica)
            await self._remove(replica, "cold start failed")
        finally:
            replica.ready.set()

    async def _remove(self, replica: Replica, reason: str, keep_warm: bool = False) -> None:
        if self._replicas.pop(replica.id, None) is None:
            return
        replica.prefixes.clear()
        self._scaled_down(replica, reason)
        info: WorkerInfo | None = None
        self._unloading += 1
        try:
            if keep_warm:
                info = await self._unload(replica)
        finally:
            self._unloading -= 1
            if info is None:  # also when cancelled mid-unload: never orphan the process
                await self.launcher.stop(replica.handle)
        if info is not None:
            idle = IdleWorker(replica.handle, info, replica.deployment)
            if not self._hand_over(idle):
                self.warm.offer(idle)
        self._grant()  # a queued cold start takes the freed slot before the warm pool does

    def _hand_over(self, idle: IdleWorker) -> bool:
        """Give a just-unloaded worker to the first cold start waiting for a slot: an
        eviction swaps models in one process (no process start; the evicted model stays in
        its host tier) even when no idle workers are kept."""
        if self._queue_head() is None:
            return False
        self._give_slot(idle)
        return True

    async def _unload(self, replica: Replica) -> WorkerInfo | None:
        """Unload the replica's model so its worker can idle or serve a queued cold start;
        None: stop the worker instead."""
        worker = replica.worker
        if (
            (self.warm.target == 0 and self._queue_head() is None)
            or self._closing
            or worker is None
            or replica.load is None
            or self.backend.exit_reason(replica.handle)
        ):
            return None
        unloaded = await self.launcher.unload(worker, replica.id)
        return worker if unloaded and not self._closing else None

    def _forget(self, replica: Replica, reason: str) -> None:
        if self._replicas.pop(replica.id, None) is None:
            return
        replica.prefixes.clear()
        self.registry.forget(replica.handle.worker_id)
        self._scaled_down(replica, reason)

    def _scaled_down(self, replica: Replica, reason: str) -> None:
        if replica.retired:  # its deployment is gone: a new one's history is not its own
            log.info("replica %s of deleted %s removed", replica.id, replica.deployment)
            return
        after = len(self.replicas(replica.deployment))
        self.on_scale(ScaleEvent(replica.deployment, after + 1, after, reason, replica.id))


def _version_of(waiting: Replica, victim: Replica) -> str:
    """``waiting``'s deployment as a scale event names it, with its version when the victim
    is another version of the same deployment."""
    if victim.deployment == waiting.deployment:
        return f"{waiting.deployment} version {waiting.generation}"
    return waiting.deployment
