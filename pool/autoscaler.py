"""Reconcile replicas with demand once a second: keep ``min_replicas``, release idle ones.

Scale-up on demand happens in the router the moment a request finds no replica; this loop
handles what time decides: idle timeouts (down to zero), minimum replicas, dead workers.
Target-concurrency scaling and a stable window arrive with issue 6.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from hotpool.billing.deployments import DeploymentSpec
from hotpool.pool.pool import PoolError, WorkerPool
from hotpool.pool.replica import ReplicaState

log = logging.getLogger("hotpool.autoscaler")


class Autoscaler:
    def __init__(
        self,
        pool: WorkerPool,
        deployments: Callable[[], Mapping[str, DeploymentSpec]],
        interval_s: float = 1.0,
    ) -> None:
        self.pool = pool
        self.deployments = deployments
        self.interval_s = interval_s

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("autoscaler tick failed")
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> None:
        for dead in self.pool.reap_dead():
            log.warning("replica %s of %s lost: %s", dead.id, dead.deployment, dead.error)
        specs = self.deployments()
        now = time.monotonic()
        for name in {r.deployment for r in self.pool.replicas()} | set(specs):
            spec = specs.get(name)
            replicas = self.pool.replicas(name)
            live = [r for r in replicas if r.state is not ReplicaState.DRAINING]
            floor = spec.min_replicas if spec else 0
            idle = sorted(
                (r for r in live if r.state is ReplicaState.READY and r.inflight == 0),
                key=lambda r: r.last_used,
            )
            timeout = spec.idle_timeout_s if spec else 0.0
            for r in idle:
                if len(live) <= floor:
                    break
                if now - r.last_used >= timeout:
                    live.remove(r)
                    reason = "idle timeout" if spec else "deployment deleted"
                    self.pool.release_soon(r, reason)
            if spec is not None and len(live) < floor:
                try:
                    await self.pool.scale_up(spec, reason="min_replicas")
                except PoolError as exc:
                    log.warning("cannot keep %s at min_replicas=%d: %s", name, floor, exc)
