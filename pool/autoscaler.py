"""Reconcile each deployment's replicas with its load: up at once, down only when stable.

Load is what a replica actually holds, counted two ways, and the larger need wins:

- requests: in flight plus queued for the deployment; ceil(load / ``target_concurrency``)
  replicas (so ``target_concurrency`` bounds the requests a replica holds);
- tokens: the replicas' backlog in seconds of their own measured work (prompt tokens still
  to compute, less cached prefixes, and output tokens expected; pool/capacity.py), plus
  the queued requests' at the replicas' mean rates; ceil(backlog / ``backlog_s``)
  replicas. A few very long prompts weigh what they cost, as many short ones do;
- and one more replica than live while the live ones' KV caches are nearly full
  (``KV_FULL``: requests would start being preempted).

Desired replicas are within ``min_replicas`` and ``max_replicas``. Scaling up happens the
moment the desired count exceeds the live one (the router wakes this loop on every queued
request and whenever a replica passes its target, and it ticks every second regardless).
Scaling down follows the highest desired count seen over the last ``scale_down_window_s``
(as Kubernetes' HPA stabilisation window does), so a burst that pauses between requests
does not flap; the last replica goes only after ``idle_timeout_s`` without requests (scale
to zero). Dead workers are reaped here.

While a canary runs, the stable and the canary version are reconciled each on their own
load (their own replicas, their own queue): the canary may scale to zero while the stable
version keeps ``min_replicas``. Replicas of any other version are stale: they drain once
the stable version has a ready replica (a roll-out, a promote or a rollback).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping

from hotpool.billing.deployments import DeploymentSpec
from hotpool.pool.capacity import backlog_seconds, mean_rates, rates
from hotpool.pool.pool import WorkerPool
from hotpool.pool.replica import Replica, ReplicaState

KV_FULL = 0.9  # mean KV usage of the live replicas past which one more is asked for

log = logging.getLogger("hotpool.autoscaler")


class Autoscaler:
    def __init__(
        self,
        pool: WorkerPool,
        deployments: Callable[[], Mapping[str, DeploymentSpec]],
        queued: Callable[[str, int], int] = lambda name, version: 0,
        interval_s: float = 1.0,
        scale_down_window_s: float = 30.0,
        canary_of: Callable[[DeploymentSpec], DeploymentSpec | None] = lambda spec: None,
        waiting_work: Callable[[str, int], tuple[int, int]] = lambda name, version: (0, 0),
        backlog_s: float = 10.0,
    ) -> None:
        self.pool = pool
        self.deployments = deployments
        self.queued = queued  # requests waiting for (deployment, version)
        self.waiting_work = waiting_work  # their (prompt, output) tokens
        self.backlog_s = backlog_s  # seconds of work a replica may hold before another comes
        self.canary_of = canary_of
        self.interval_s = interval_s
        self.scale_down_window_s = scale_down_window_s
        self._wake = asyncio.Event()
        # (time, desired) recommendations per (deployment, version) within the window.
        self._history: defaultdict[tuple[str, int], deque[tuple[float, int]]] = defaultdict(deque)

    def forget(self, name: str) -> None:
        """``name`` was deleted: its window of recommendations goes (a new deployment may
        take the name, and must not scale on the old one's load)."""
        for key in [k for k in self._history if k[0] == name]:
            del self._history[key]

    def wake(self) -> None:
        """Reconcile now (demand just changed) instead of at the next tick."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("autoscaler tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()

    async def tick(self) -> None:
        self.pool.reap_dead()
        if self.pool.closing:
            return  # the server is stopping: its streams drain, nothing is scaled
        specs = self.deployments()
        now = time.monotonic()
        names = {r.deployment for r in self.pool.replicas()} | {k[0] for k in self._history}
        for name in names | set(specs):
            spec = specs.get(name)
            if spec is None:
                self.forget(name)
                self.pool.retire(name)  # the API does this at once; any other delete, here
                continue
            self._reconcile(spec, now)

    def desired(self, spec: DeploymentSpec, floor: int | None = None) -> tuple[int, int]:
        """(desired replicas, load in requests) for the version ``spec`` describes, now."""
        want, load, _ = self.need(spec, floor)
        return want, load

    def need(self, spec: DeploymentSpec, floor: int | None = None) -> tuple[int, int, str]:
        """(desired replicas, load in requests, why) for the version ``spec`` describes."""
        live = self._live(spec.name, spec.generation)
        load = sum(r.inflight for r in live) + self.queued(spec.name, spec.generation)
        want = math.ceil(load / spec.target_concurrency)
        why = f"load {load} > {len(live)} x target_concurrency {spec.target_concurrency}"
        ready = [r for r in live if r.state is ReplicaState.READY]
        backlog = self.backlog(spec, ready)
        if backlog is not None and math.ceil(backlog / self.backlog_s) > want:
            want = math.ceil(backlog / self.backlog_s)
            why = f"backlog {backlog:.1f}s of measured work > {len(live)} x {self.backlog_s:g}s"
        usage = [r.kv_cache_usage for r in ready if r.kv_cache_usage is not None]
        full = bool(usage) and len(usage) == len(live) and sum(usage) / len(usage) >= KV_FULL
        if full and len(live) + 1 > want:
            want = len(live) + 1
            why = f"KV cache {sum(usage) / len(usage):.0%} used on {len(live)} replica(s)"
        low = spec.min_replicas if floor is None else floor
        return min(max(want, low), spec.max_replicas), load, why

    def backlog(self, spec: DeploymentSpec, live: list[Replica]) -> float | None:
        """Seconds of work the version's replicas hold, each at its measured rates, and its
        queued requests' at their mean; None until a replica has measured its speed."""
        measured = {r.id: x for r in live if (x := rates(r.capacity)) is not None}
        typical = mean_rates(list(measured.values()))
        if typical is None:
            return None
        total = 0.0
        for r in live:
            x = measured.get(r.id, typical)
            total += backlog_seconds(r.queued_tokens, r.queued_output_tokens, r.inflight, x)
        prompt, output = self.waiting_work(spec.name, spec.generation)
        return total + backlog_seconds(prompt, output, spec.target_concurrency, typical)

    def _reconcile(self, spec: DeploymentSpec, now: float) -> None:
        canary = self.canary_of(spec) if spec.canary_version is not None else None
        self.pool.remember(spec, canary)
        versions = {spec.generation} | ({canary.generation} if canary else set())
        live = [r for r in self._live(spec.name) if r.generation in versions]
        stale = [r for r in self._live(spec.name) if r.generation not in versions]
        for key in [k for k in self._history if k[0] == spec.name and k[1] not in versions]:
            del self._history[key]  # a version that ended: its window goes with it
        current = [r for r in live if r.generation == spec.generation]
        self._reconcile_version(spec, current, stale, spec.min_replicas, now)
        if canary is not None:
            mine = [r for r in live if r.generation == canary.generation]
            self._reconcile_version(canary, mine, [], 0, now, canary=True)

    def _reconcile_version(
        self,
        spec: DeploymentSpec,
        live: list[Replica],
        stale: list[Replica],
        floor: int,
        now: float,
        canary: bool = False,
    ) -> None:
        """Scale one version's replicas (``live``) to its load, within [floor, max]."""
        want, load, why = self.need(spec, floor)
        if stale:
            self._roll_over(spec, live, stale)
            want = max(want, min(len(stale), spec.max_replicas))
        history = self._history[(spec.name, spec.generation)]
        history.append((now, want))
        while history and history[0][0] < now - self.scale_down_window_s:
            history.popleft()
        if len(live) < want:
            if stale:
                reason = f"rolling over to version {spec.generation}"
            elif want == floor and load <= floor:
                reason = f"min_replicas={floor}"
            else:
                reason = why
            # More than max_workers at once could never get a slot: ask for what can run.
            for _ in range(min(want - len(live), self.pool.max_workers)):
                self.pool.scale_up(spec, reason=reason, canary=canary)
            return
        # Replicas still waiting for a worker are cheap to withdraw: no window for them.
        # (A replacement for a dead worker stays: it is capacity the deployment had.)
        for r in sorted(live, key=lambda r: r.requested_at, reverse=True):
            if len(live) <= want or r.state is not ReplicaState.QUEUED:
                break
            if not r.replacement and self.pool.cancel(
                r, "demand went away before a worker was free"
            ):
                live.remove(r)
        stable = max((w for _, w in history), default=want)
        keep = max(stable, floor, 1)
        idle = sorted(
            (r for r in live if r.state is ReplicaState.READY and r.inflight == 0),
            key=lambda r: r.last_used,
        )
        for r in idle:
            if len(live) <= floor:
                break
            if now - r.last_used >= spec.idle_timeout_s and len(live) > want:
                # Idle only because the router filled another replica first (streams that
                # queued for the first ready one): the load still needs it, so it stays.
                reason = "idle timeout"
            elif len(live) > keep:
                reason = f"load {load} fits {keep} replica(s) for {self.scale_down_window_s:g}s"
            else:
                break
            live.remove(r)
            self.pool.release_soon(r, reason)

    def _roll_over(
        self, spec: DeploymentSpec, current: list[Replica], stale: list[Replica]
    ) -> None:
        """What replicas run changed (a new snapshot, dtype or engine options; a promote or
        a rollback): new replicas start at once, as many as the old ones (within
        ``max_replicas``); the old ones serve until one new replica is ready, then drain.
        The router prefers the new version as soon as it is ready, so no request is
        dropped."""
        if any(r.state is ReplicaState.READY for r in current):
            for r in stale:
                self.pool.release_soon(r, f"rolled over to version {spec.generation}")

    def _live(self, name: str, version: int | None = None) -> list[Replica]:
        return [
            r
            for r in self.pool.replicas(name)
            if r.state is not ReplicaState.DRAINING and (version is None or r.generation == version)
        ]
