"""Pick a replica for each request; hold requests through a cold start, within bounds.

The ready replica with the fewest outstanding requests wins. With none ready, the request
waits (at most ``max_queue`` per deployment, at most ``queue_timeout_s``) for the replica
the pool is starting, starting one if there is none; a full queue or an expired wait is a
503 with ``Retry-After``, never a hang. Demand beyond one replica is the autoscaler's: the
router wakes it whenever requests queue or a replica passes its target concurrency.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from hotpool.billing.deployments import DeploymentSpec
from hotpool.platform.errors import APIError
from hotpool.pool.pool import WorkerPool
from hotpool.pool.replica import Replica, ReplicaState


@dataclass(frozen=True)
class Lease:
    replica: Replica
    queue_seconds: float
    cold_start: bool  # this request waited for a replica to start


class Router:
    def __init__(
        self,
        pool: WorkerPool,
        max_queue: int,
        queue_timeout_s: float,
        on_demand: Callable[[], None] = lambda: None,
    ) -> None:
        self.pool = pool
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.on_demand = on_demand  # wakes the autoscaler
        self.waiting: Counter[str] = Counter()

    def queued(self, deployment: str) -> int:
        return self.waiting[deployment]

    @asynccontextmanager
    async def lease(
        self, spec: DeploymentSpec, avoid: Replica | None = None
    ) -> AsyncIterator[Lease]:
        """A replica for one request; ``avoid``: one that just failed it (used only if it is
        the only one ready)."""
        t0 = time.monotonic()
        replica, cold = await self._acquire(spec, t0, avoid)
        try:
            yield Lease(replica, time.monotonic() - t0, cold)
        finally:
            replica.inflight -= 1
            replica.last_used = time.monotonic()

    async def _acquire(
        self, spec: DeploymentSpec, t0: float, avoid: Replica | None
    ) -> tuple[Replica, bool]:
        ready = self._pick(spec, avoid)
        if ready is not None:
            return ready, False
        max_queue = spec.max_queue or self.max_queue
        timeout_s = spec.queue_timeout_s or self.queue_timeout_s
        if self.waiting[spec.name] >= max_queue:
            raise APIError(
                503, f"deployment {spec.name!r} has {max_queue} requests queued; retry later",
                code="queue_full", retry_after_s=5,
            )  # fmt: skip
        self.waiting[spec.name] += 1
        self.on_demand()
        try:
            while True:
                starting = [
                    r
                    for r in self.pool.replicas(spec.name)
                    if r.starting and r.generation == spec.generation
                ]
                if starting:
                    replica = min(starting, key=lambda r: r.requested_at)
                else:
                    replica = self.pool.scale_up(spec, reason="request")
                remaining = timeout_s - (time.monotonic() - t0)
                try:
                    await asyncio.wait_for(replica.ready.wait(), max(remaining, 0.0))
                except TimeoutError:
                    wait = f"{timeout_s:g}s"
                    raise APIError(
                        503, f"no replica of {spec.name!r} became ready within {wait}",
                        code="queue_timeout", retry_after_s=10,
                    ) from None  # fmt: skip
                picked = self._pick(spec, avoid)
                if picked is not None:
                    return picked, True
                if replica.error is not None and replica.state is not ReplicaState.QUEUED:
                    raise APIError(503, f"cold start of {spec.name!r} failed: {replica.error}",
                                   code="cold_start_failed", retry_after_s=10)  # fmt: skip
        finally:
            self.waiting[spec.name] -= 1

    def _pick(self, spec: DeploymentSpec, avoid: Replica | None) -> Replica | None:
        ready = [r for r in self.pool.replicas(spec.name) if r.state is ReplicaState.READY]
        if not ready:
            return None
        # During a roll-over the new generation takes requests as soon as it is ready.
        ready = [r for r in ready if r.generation == spec.generation] or ready
        best = min(ready, key=lambda r: (r is avoid, r.inflight))
        best.inflight += 1  # claimed before any await, so the autoscaler sees it busy
        if best.inflight > spec.target_concurrency:
            self.on_demand()
        return best
