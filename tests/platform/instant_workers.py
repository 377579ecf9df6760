"""Stand-in workers for control-plane tests: they register the moment they start, with no
process and no model (a test answers the pool's calls to them with an httpx MockTransport)."""

from __future__ import annotations

import asyncio

from hotpool.pool.backend import WorkerBackend, WorkerHandle
from hotpool.pool.registry import WorkerRegistry
from hotpool.worker.protocol import WorkerInfo


class InstantBackend(WorkerBackend):
    def __init__(self, registry: WorkerRegistry | None = None) -> None:
        # An app built around the backend has its own registry: set it here once built.
        self.registry = registry or WorkerRegistry()
        self.running: set[str] = set()

    async def start(self, worker_id: str) -> WorkerHandle:
        self.running.add(worker_id)
        info = WorkerInfo(worker_id, f"http://{worker_id}.test", 1, "cpu", 1)
        asyncio.get_running_loop().call_soon(self.registry.register, info)
        return WorkerHandle(worker_id, 1)

    async def stop(self, handle: WorkerHandle, grace_s: float = 10.0) -> None:
        self.running.discard(handle.worker_id)

    def exit_reason(self, handle: WorkerHandle) -> str | None:
        return None if handle.worker_id in self.running else "stopped"
