"""Pick a replica for each request; hold requests through a cold start, within bounds.

The ready replica with the fewest outstanding requests wins. With none ready, the request
waits (at most ``max_queue`` per deployment, at most ``queue_timeout_s``) while the pool
cold-starts one; a full queue or an expired wait is a 503 with ``Retry-After``, never a hang.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from hotpool.billing.deployments import DeploymentSpec
from hotpool.platform.errors import APIError
from hotpool.pool.pool import PoolError, WorkerPool
from hotpool.pool.replica import Replica, ReplicaState


@dataclass(frozen=True)
class Lease:
    replica: Replica
    queue_seconds: float
    cold_start: bool  # this request waited for a replica to start


class Router:
    def __init__(self, pool: WorkerPool, max_queue: int, queue_timeout_s: float) -> None:
        self.pool = pool
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.waiting: Counter[str] = Counter()

    @asynccontextmanager
    async def lease(self, spec: DeploymentSpec) -> AsyncIterator[Lease]:
        t0 = time.monotonic()
        replica, cold = await self._acquire(spec, t0)
        try:
            yield Lease(replica, time.monotonic() - t0, cold)
        finally:
            replica.inflight -= 1
            replica.last_used = time.monotonic()

    async def _acquire(self, spec: DeploymentSpec, t0: float) -> tuple[Replica, bool]:
        ready = self._pick(spec.name)
        if ready is not None:
            return ready, False
        if self.waiting[spec.name] >= self.max_queue:
            raise APIError(
                503, f"deployment {spec.name!r} has {self.max_queue} requests queued; retry later",
                code="queue_full", retry_after_s=5,
            )  # fmt: skip
        self.waiting[spec.name] += 1
        try:
            while True:
                starting = [
                    r
                    for r in self.pool.replicas(spec.name)
                    if r.state in (ReplicaState.COLD, ReplicaState.LOADING)
                ]
                try:
                    replica = starting[0] if starting else await self.pool.scale_up(spec)
                except PoolError as exc:
                    raise APIError(
                        503, str(exc), code="no_capacity", retry_after_s=exc.retry_after_s
                    ) from exc
                remaining = self.queue_timeout_s - (time.monotonic() - t0)
                try:
                    await asyncio.wait_for(replica.ready.wait(), max(remaining, 0.0))
                except TimeoutError:
                    wait = f"{self.queue_timeout_s:g}s"
                    raise APIError(
                        503, f"no replica of {spec.name!r} became ready within {wait}",
                        code="queue_timeout", retry_after_s=10,
                    ) from None  # fmt: skip
                if replica.error is not None:
                    raise APIError(503, f"cold start of {spec.name!r} failed: {replica.error}",
                                   code="cold_start_failed", retry_after_s=10)  # fmt: skip
                picked = self._pick(spec.name)
                if picked is not None:
                    return picked, True
        finally:
            self.waiting[spec.name] -= 1

    def _pick(self, deployment: str) -> Replica | None:
        ready = [r for r in self.pool.replicas(deployment) if r.state is ReplicaState.READY]
        if not ready:
            return None
        best = min(ready, key=lambda r: r.inflight)
        best.inflight += 1  # claimed before any await, so the autoscaler sees it busy
        return best
