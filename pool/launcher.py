"""One worker's life as the pool drives it: start and wait for registration, load a
snapshot, unload it, stop. The pool decides when; this module does the I/O."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable

import httpx

from hotpool.billing.deployments import DeploymentSpec
from hotpool.pool.backend import WorkerBackend, WorkerHandle
from hotpool.pool.registry import WorkerRegistry
from hotpool.worker.protocol import LoadRequest, LoadResult, WorkerInfo

log = logging.getLogger("hotpool.pool")


class PoolError(Exception):
    """The pool cannot give this deployment a replica now; ``retry_after_s`` is a hint."""

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ColdStartFailed(PoolError):
    pass


class WorkerLauncher:
    def __init__(
        self,
        backend: WorkerBackend,
        registry: WorkerRegistry,
        worker_token: str,
        start_timeout_s: float,
        closing: Callable[[], bool],
    ) -> None:
        self.backend = backend
        self.registry = registry
        self.start_timeout_s = start_timeout_s
        self._closing = closing
        # Worker calls can stream for minutes; only connecting is bounded.
        self.client = httpx.AsyncClient(
            headers={"authorization": f"Bearer {worker_token}"},
            timeout=httpx.Timeout(None, connect=10.0),
        )

    async def start(self, worker_id: str) -> tuple[WorkerHandle, WorkerInfo]:
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
            if self._closing():
                raise ColdStartFailed("the pool is shutting down")
            try:
                return await self.registry.wait_registered(handle.worker_id, 0.25)
            except TimeoutError:
                pass
            if why := self.backend.exit_reason(handle):
                raise ColdStartFailed(why)
            if time.monotonic() - t0 > self.start_timeout_s:
                raise ColdStartFailed(f"worker did not register within {self.start_timeout_s:.0f}s")

    async def load(self, worker: WorkerInfo, spec: DeploymentSpec) -> LoadResult:
        body = LoadRequest(
            spec.name,
            spec.snapshot_uri,
            spec.dtype,
            spec.max_model_len,
            spec.kv_cache_bytes,
            quantization=spec.quantization,
            speculative=None if spec.speculative is None else json.loads(spec.speculative),
        ).to_json()
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

    async def unload(self, worker: WorkerInfo, what: str) -> bool:
        """Ask ``worker`` to drop its model; False if it could not (stop it instead)."""
        try:
            r = await self.client.post(f"{worker.address}/unload", timeout=30.0)
        except httpx.HTTPError as exc:
            log.warning("unload of %s failed: %s", what, exc)
            return False
        return r.status_code == 200

    async def stop(self, handle: WorkerHandle, grace_s: float = 10.0) -> None:
        """Stop the process (SIGTERM, SIGKILL after ``grace_s``; 0 = at once); idempotent."""
        self.registry.forget(handle.worker_id)
        with contextlib.suppress(Exception):
            await self.backend.stop(handle, grace_s)

    async def close(self) -> None:
        await self.client.aclose()
