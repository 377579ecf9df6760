"""The worker pool: turns workers into replicas of deployments and back.

A cold start runs in the background: claim an idle worker (or start a worker process and
wait for it to register), then ask it to load the deployment's snapshot. Callers wait on the
replica's ``ready`` event, so requests queue through a cold start instead of failing.
Releasing a replica drains it (no new requests, in-flight ones finish), unloads its model and
returns the worker to the idle set (``warm_workers`` of them, refilled in the background), or
stops it when the idle set is full. Idle workers count within ``max_workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import httpx

from hotpool.billing.deployments import DeploymentSpec
from hotpool.pool.backend import WorkerBackend, WorkerHandle
from hotpool.pool.registry import WorkerRegistry
from hotpool.pool.replica import Replica, ReplicaState
from hotpool.pool.warm import IdleWorker, WarmPool
from hotpool.worker.protocol import LoadRequest, LoadResult, WorkerInfo

log = logging.getLogger("hotpool.pool")


class PoolError(Exception):
    """The pool cannot give this deployment a replica now; ``retry_after_s`` is a hint."""

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ColdStartFailed(PoolError):
    pass


class PoolExhausted(PoolError):
    pass


@dataclass(frozen=True)
class ScaleEvent:
    deployment: str
    from_replicas: int
    to_replicas: int
    reason: str
    cold_start_seconds: float | None = None


class WorkerPool:
    def __init__(
        self,
        backend: WorkerBackend,
        registry: WorkerRegistry,
        worker_token: str,
        max_workers: int,
        start_timeout_s: float,
        warm_workers: int = 0,
        on_scale: Callable[[ScaleEvent], None] | None = None,
        on_ready: Callable[[Replica], None] | None = None,
    ) -> None:
        self.backend = backend
        self.registry = registry
        self.max_workers = max_workers
        self.start_timeout_s = start_timeout_s
        self.on_scale = on_scale or (lambda e: None)
        self.on_ready = on_ready or (lambda r: None)
        self._replicas: dict[str, Replica] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.warm = WarmPool(
            min(warm_workers, max_workers),
            self._start_worker,
            self._stop_worker,
            room=lambda: self._processes() < self.max_workers,
        )
        self._unloading = 0  # released workers between replica and idle (still processes)
        self._closing = False
        # Worker calls can stream for minutes; only connecting is bounded.
        self.client = httpx.AsyncClient(
            headers={"authorization": f"Bearer {worker_token}"},
            timeout=httpx.Timeout(None, connect=10.0),
        )

    def replicas(self, deployment: str | None = None) -> list[Replica]:
        return [r for r in self._replicas.values() if deployment in (None, r.deployment)]

    def idle_workers(self) -> list[IdleWorker]:
        return self.warm.idle.all()

    def start(self) -> None:
        """Begin filling the idle set (call once the event loop runs)."""
        self.warm.refill()

    async def scale_up(self, spec: DeploymentSpec, reason: str = "request") -> Replica:
        """Start a replica of ``spec``; returns at once, in state COLD (await ``ready``)."""
        requested = time.monotonic()
        source = self.warm.claim(spec.name)
        if source is None and self._processes() >= self.max_workers:
            await self._evict_one()  # its worker may come back idle: claim it then
            source = self.warm.claim(spec.name)
        before = len(self.replicas(spec.name))
        handle = source.handle if isinstance(source, IdleWorker) else None
        replica = Replica(
            id=f"r-{uuid.uuid4().hex[:12]}",
            deployment=spec.name,
            handle=handle or WorkerHandle(f"w-{uuid.uuid4().hex[:12]}"),
        )
        self._replicas[replica.id] = replica
        self.on_scale(ScaleEvent(spec.name, before, before + 1, reason))
        self._spawn(self._cold_start(replica, spec, requested, source))
        self.warm.refill()
        return replica

    def _processes(self) -> int:
        return len(self._replicas) + len(self.warm) + self._unloading

    def release_soon(self, replica: Replica, reason: str) -> None:
        """:meth:`release` in the background (the autoscaler must not wait for a drain)."""
        self._spawn(self.release(replica, reason))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def release(self, replica: Replica, reason: str, grace_s: float = 30.0) -> None:
        """Drain ``replica`` (in-flight requests finish), then unload it and keep its worker
        idle (its model stays in the worker's host tier), or stop the worker."""
        if replica.id not in self._replicas or replica.state is ReplicaState.DRAINING:
            return
        replica.state = ReplicaState.DRAINING
        deadline = time.monotonic() + grace_s
        while replica.inflight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110 (a counter)
            await asyncio.sleep(0.05)
        await self._remove(replica, reason, keep_warm=True)

    async def shutdown(self) -> None:
        self._closing = True  # warm starts end on their own (no orphaned process)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(
            self.warm.close(), *(self._remove(r, "shutdown") for r in self.replicas())
        )
        await self.client.aclose()

    def reap_dead(self) -> list[Replica]:
        """Replicas whose worker process has died; removed from the pool (caller logs).
        Dead idle workers are dropped and replaced."""
        self.warm.reap(self.backend.exit_reason)
        dead = []
        for r in self.replicas():
            if r.state is ReplicaState.READY and (why := self.backend.exit_reason(r.handle)):
                r.error = why
                dead.append(r)
        for r in dead:
            self._forget(r, f"worker died: {r.error}")
        return dead

    async def _evict_one(self) -> None:
        idle = [r for r in self.replicas() if r.state is ReplicaState.READY and r.inflight == 0]
        if not idle:
            raise PoolExhausted(f"all {self.max_workers} workers are busy; retry shortly")
        victim = min(idle, key=lambda r: r.last_used)  # least recently used
        await self.release(victim, "evicted for another deployment")

    async def _cold_start(
        self,
        replica: Replica,
        spec: DeploymentSpec,
        requested: float,
        source: IdleWorker | asyncio.Task[IdleWorker] | None,
    ) -> None:
        """Get a worker, load the snapshot. Phases (seconds): ``queue`` (waiting for a worker
        slot), ``start`` (claiming an idle worker, or process start to registration), then
        the worker's ``fetch``, ``load`` and ``warmup``."""
        t0 = time.monotonic()
        try:
            if isinstance(source, IdleWorker):
                worker: IdleWorker | None = source
            elif source is not None:
                worker = await source
            else:
                worker = None
            if worker is not None:
                replica.handle, replica.worker = worker.handle, worker.info
            else:
                replica.handle, replica.worker = await self._start_worker(replica.handle.worker_id)
            t1 = time.monotonic()
            replica.state = ReplicaState.LOADING
            load = await self._load(replica.worker, spec)
            phases = {"queue": t0 - requested, "start": t1 - t0, **load.phases}
            replica.load = replace(load, phases=phases)
            replica.cold_start_seconds = time.monotonic() - requested
            replica.last_used = time.monotonic()
            replica.state = ReplicaState.READY
            self.on_ready(replica)
            log.info(
                "replica %s of %s ready in %.2fs %s",
                replica.id, spec.name, replica.cold_start_seconds, replica.load.phases,
            )  # fmt: skip
        except Exception as exc:
            replica.error = str(exc) or type(exc).__name__
            log.error("cold start of %s failed: %s", spec.name, replica.error)
            await self._remove(replica, "cold start failed")
        finally:
            replica.ready.set()

    async def _start_worker(self, worker_id: str) -> tuple[WorkerHandle, WorkerInfo]:
        """Start a worker process and wait for it to register; stops it if that fails."""
        self.registry.expect(worker_id)
        handle = await self.backend.start(worker_id)
        try:
            return handle, await self._wait_registered(handle, time.monotonic())
        except BaseException:
            self.registry.forget(worker_id)
            with contextlib.suppress(Exception):
                await self.backend.stop(handle)
            raise

    async def _wait_registered(self, handle: WorkerHandle, t0: float) -> WorkerInfo:
        while True:
            if self._closing:
                raise ColdStartFailed("the pool is shutting down")
            try:
                return await self.registry.wait_registered(handle.worker_id, 0.25)
            except TimeoutError:
                pass
            if why := self.backend.exit_reason(handle):
                raise ColdStartFailed(why)
            if time.monotonic() - t0 > self.start_timeout_s:
                raise ColdStartFailed(f"worker did not register within {self.start_timeout_s:.0f}s")

    async def _load(self, worker: WorkerInfo, spec: DeploymentSpec) -> LoadResult:
        body = LoadRequest(spec.name, spec.snapshot_uri).to_json()
        r = await self.client.post(
            f"{worker.address}/load", json=body, timeout=self.start_timeout_s
        )
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500]
            raise ColdStartFailed(message)
        return LoadResult.from_json(r.json())

    async def _remove(self, replica: Replica, reason: str, keep_warm: bool = False) -> None:
        if self._replicas.pop(replica.id, None) is None:
            return
        self._scaled_down(replica, reason)
        info: WorkerInfo | None = None
        self._unloading += 1
        try:
            if keep_warm:
                info = await self._unload(replica)
        finally:
            self._unloading -= 1
            if info is None:  # also when cancelled mid-unload: never orphan the process
                await self._stop_worker(replica.handle)
        if info is not None:
            self.warm.offer(IdleWorker(replica.handle, info, replica.deployment))
        self.warm.refill()

    async def _unload(self, replica: Replica) -> WorkerInfo | None:
        """Unload the replica's model so its worker can idle; None: stop the worker instead."""
        worker = replica.worker
        if (
            self.warm.target == 0
            or self._closing
            or worker is None
            or replica.load is None
            or self.backend.exit_reason(replica.handle)
        ):
            return None
        try:
            r = await self.client.post(f"{worker.address}/unload", timeout=30.0)
        except httpx.HTTPError as exc:
            log.warning("unload of %s failed: %s", replica.id, exc)
            return None
        return worker if r.status_code == 200 and not self._closing else None

    async def _stop_worker(self, handle: WorkerHandle) -> None:
        self.registry.forget(handle.worker_id)
        with contextlib.suppress(Exception):
            await self.backend.stop(handle)

    def _forget(self, replica: Replica, reason: str) -> None:
        if self._replicas.pop(replica.id, None) is None:
            return
        self.registry.forget(replica.handle.worker_id)
        self._scaled_down(replica, reason)

    def _scaled_down(self, replica: Replica, reason: str) -> None:
        after = len(self.replicas(replica.deployment))
        self.on_scale(ScaleEvent(replica.deployment, after + 1, after, reason))
