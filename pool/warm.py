"""Idle workers: registered worker processes that hold no model, kept ready for a cold start.

:class:`IdleWorkers` is the bookkeeping (no I/O); :class:`WarmPool` starts and stops them
through callables the pool gives it. The idle set is least-recently-used: a worker just
released by a replica joins as the newest (its host-memory tier still holds that model), and
the oldest goes first when there are too many.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hotpool.pool.backend import WorkerHandle
from hotpool.worker.protocol import WorkerInfo

log = logging.getLogger("hotpool.pool")


@dataclass(eq=False)
class IdleWorker:
    handle: WorkerHandle
    info: WorkerInfo
    last_deployment: str | None = None  # what its host tier may still hold


class IdleWorkers:
    """At most ``limit`` idle workers, oldest first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._workers: OrderedDict[str, IdleWorker] = OrderedDict()

    def __len__(self) -> int:
        return len(self._workers)

    def all(self) -> list[IdleWorker]:
        return list(self._workers.values())

    def add(self, worker: IdleWorker) -> list[IdleWorker]:
        """Add ``worker`` as the newest; returns the oldest ones now over the limit (to stop)."""
        self._workers[worker.handle.worker_id] = worker
        over = []
        while len(self._workers) > self.limit:
            over.append(self._workers.popitem(last=False)[1])
        return over

    def take(self, deployment: str) -> IdleWorker | None:
        """The worker that last served ``deployment`` (its weights may be in RAM), else the
        oldest (its host tier is the least likely to be wanted again)."""
        for worker_id, w in self._workers.items():
            if w.last_deployment == deployment:
                return self._workers.pop(worker_id)
        if not self._workers:
            return None
        return self._workers.popitem(last=False)[1]

    def pop_oldest(self) -> IdleWorker | None:
        return self._workers.popitem(last=False)[1] if self._workers else None

    def reap(self, exit_reason: Callable[[WorkerHandle], str | None]) -> list[IdleWorker]:
        """Drop and return the workers whose process has ended."""
        dead = [w for w in self._workers.values() if exit_reason(w.handle)]
        for w in dead:
            del self._workers[w.handle.worker_id]
        return dead


StartWorker = Callable[[str], Awaitable[tuple[WorkerHandle, WorkerInfo]]]
StopWorker = Callable[[WorkerHandle], Awaitable[None]]


class WarmPool:
    """Keeps ``target`` idle workers ready, starting them in the background while ``room()``
    says another process fits; a cold start :meth:`claim`\\ s one, a released replica
    :meth:`offer`\\ s its worker back. Failed starts back off so a broken worker cannot spin."""

    def __init__(
        self,
        target: int,
        start: StartWorker,
        stop: StopWorker,
        room: Callable[[], bool],
        on_idle: Callable[[], None] = lambda: None,
    ) -> None:
        self.target = target
        self.idle = IdleWorkers(target)
        self._start, self._stop, self._room = start, stop, room
        self._on_idle = on_idle  # a worker just became idle: a queued cold start may take it
        # Starting; a cold start may claim one before it registers.
        self._warming: dict[str, asyncio.Task[IdleWorker]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._retry_at = 0.0
        self._backoff_s = 1.0
        self._closing = False

    def __len__(self) -> int:
        """Worker processes held here (idle or starting)."""
        return len(self.idle) + len(self._warming)

    def claim(self, deployment: str) -> IdleWorker | asyncio.Task[IdleWorker] | None:
        """An idle worker, else one still starting (it registers sooner than a new process
        would), else None."""
        if (idle := self.idle.take(deployment)) is not None:
            return idle
        if self._warming:
            return self._warming.pop(next(iter(self._warming)))
        return None

    def refill(self) -> None:
        if self._closing or time.monotonic() < self._retry_at:
            return
        while len(self) < self.target and self._room():
            worker_id = f"w-{uuid.uuid4().hex[:12]}"
            task = asyncio.create_task(self._start_idle(worker_id))
            self._warming[worker_id] = task
            task.add_done_callback(lambda t, w=worker_id: self._started(w, t))

    def offer(self, worker: IdleWorker) -> None:
        """Keep ``worker`` as the newest idle one; the oldest over the limit is stopped."""
        for old in self.idle.add(worker):
            self._stop_soon(old.handle)

    def reap(self, exit_reason: Callable[[WorkerHandle], str | None]) -> None:
        """Drop idle workers whose process died, and start their replacements."""
        for w in self.idle.reap(exit_reason):
            log.warning("idle worker %s died: %s", w.handle.worker_id, exit_reason(w.handle))
            self._stop_soon(w.handle)  # forgets its registration
        self.refill()

    async def close(self) -> None:
        """Stop every idle worker; those starting end on their own (the pool is closing)."""
        self._closing = True
        started = await asyncio.gather(
            *self._warming.values(), *self._stopping, return_exceptions=True
        )
        idle = [*self.idle.all(), *(w for w in started if isinstance(w, IdleWorker))]
        await asyncio.gather(*(self._stop(w.handle) for w in idle), return_exceptions=True)

    async def _start_idle(self, worker_id: str) -> IdleWorker:
        handle, info = await self._start(worker_id)
        return IdleWorker(handle, info)

    def _started(self, worker_id: str, task: asyncio.Task[IdleWorker]) -> None:
        if self._warming.pop(worker_id, None) is None or self._closing:
            return  # claimed by a cold start, or close() collects it
        if task.cancelled() or task.exception() is not None:
            why = "cancelled" if task.cancelled() else task.exception()
            log.warning("warm worker %s failed to start: %s", worker_id, why)
            self._retry_at = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, 60.0)
            return
        self._backoff_s = 1.0
        if len(self.idle) >= self.target:
            # Released workers filled the set meanwhile; theirs may hold a model in RAM.
            self._stop_soon(task.result().handle)
        else:
            self.offer(task.result())
            self._on_idle()
        self.refill()

    def _stop_soon(self, handle: WorkerHandle) -> None:
        task = asyncio.create_task(self._stop(handle))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        task.add_done_callback(lambda _: self._on_idle())  # its process slot is free now
