"""Workers that have registered with the control plane, and waiting for one to appear."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from hotpool.worker.protocol import WorkerInfo


@dataclass
class RegisteredWorker:
    info: WorkerInfo
    last_seen: float  # time.monotonic()


class UnknownWorker(KeyError):
    """A heartbeat from a worker this control plane did not start or has released."""


class WorkerRegistry:
    def __init__(self) -> None:
        self._workers: dict[str, RegisteredWorker] = {}
        self._expected: dict[str, asyncio.Future[WorkerInfo]] = {}

    def expect(self, worker_id: str) -> None:
        """Accept a registration from ``worker_id`` (the pool has just started it)."""
        self._expected[worker_id] = asyncio.get_running_loop().create_future()

    def register(self, info: WorkerInfo) -> None:
        if info.worker_id not in self._expected and info.worker_id not in self._workers:
            raise UnknownWorker(info.worker_id)
        self._workers[info.worker_id] = RegisteredWorker(info, time.monotonic())
        fut = self._expected.pop(info.worker_id, None)
        if fut is not None and not fut.done():
            fut.set_result(info)

    def heartbeat(self, info: WorkerInfo) -> None:
        worker = self._workers.get(info.worker_id)
        if worker is None:
            raise UnknownWorker(info.worker_id)
        worker.info, worker.last_seen = info, time.monotonic()

    def seen(self, worker_id: str) -> None:
        """The worker answered a call: as alive as a heartbeat says (a long load can keep
        its heartbeats late, and a loaded machine later still)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.last_seen = max(worker.last_seen, time.monotonic())

    async def wait_registered(self, worker_id: str, timeout_s: float) -> WorkerInfo:
        fut = self._expected.get(worker_id)
        if fut is None:
            return self._workers[worker_id].info
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        fut = self._expected.pop(worker_id, None)
        if fut is not None and not fut.done():
            fut.cancel()

    def get(self, worker_id: str) -> RegisteredWorker | None:
        return self._workers.get(worker_id)

    def silent_for(self, worker_id: str) -> float | None:
        """Seconds since the worker's last registration or heartbeat; None if unknown."""
        worker = self._workers.get(worker_id)
        return None if worker is None else time.monotonic() - worker.last_seen
