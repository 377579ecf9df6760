"""Prometheus metrics of the control plane (DESIGN.md: ``hotpool_`` prefix, base units,
bounded labels: deployment, status, phase, state, kind — never request ids)."""

from __future__ import annotations

import contextlib
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hotpool.platform.ledger_writer import LedgerWriter
from hotpool.platform.spec_stats import deployment_spec_stats
from hotpool.pool.pool import ScaleEvent, WorkerPool
from hotpool.pool.replica import Replica, ReplicaState
from hotpool.worker.protocol import Usage

disable_created_metrics()  # `_created` series double the output and nobody graphs them

# LLM latencies: tens of ms for a token, seconds to minutes for a cold start or a long answer.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The gap between two tokens of one answer: about a millisecond for a small model on a big
# GPU, tens of ms typically, up to seconds when a batch is full of prefills or preempted.
INTER_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class _PoolCollector(Collector):
    """Replicas, workers and queues, read from the pool at scrape time (never stale)."""

    def __init__(
        self,
        pool: WorkerPool,
        queued: Callable[[str], int],
        decisions: Callable[[], Mapping[tuple[str, str], int]] = dict,
    ) -> None:
        self.pool = pool
        self.queued = queued
        self.decisions = decisions  # the router's (deployment, reason) -> requests

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        g = GaugeMetricFamily(
            "hotpool_replicas", "Replicas by deployment and state", labels=["deployment", "state"]
        )
        replicas = self.pool.replicas()
        counts = Tally((r.deployment, r.state.value) for r in replicas)
        deployments = sorted({d for d, _ in counts})
        for deployment in deployments:
            for state in ReplicaState:
                g.add_metric([deployment, state.value], counts.get((deployment, state.value), 0))
        yield g
        by_state = self.pool.workers_by_state()
        w = GaugeMetricFamily("hotpool_workers", "Worker processes of replicas and idle workers")
        w.add_metric([], sum(by_state.values()))
        yield w
        ws = GaugeMetricFamily(
            "hotpool_workers_by_state",
            "Worker processes by state (starting, idle, loading, serving, draining)",
            labels=["state"],
        )
        for state, n in by_state.items():
            ws.add_metric([state], n)
        yield ws
        i = GaugeMetricFamily("hotpool_idle_workers", "Warm workers holding no model")
        i.add_metric([], by_state["idle"])
        yield i
        q = GaugeMetricFamily(
            "hotpool_queue_depth", "Requests waiting for a ready replica", labels=["deployment"]
        )
        inflight = GaugeMetricFamily(
            "hotpool_inflight_requests", "Requests being served", labels=["deployment"]
        )
        for deployment in deployments:
            q.add_metric([deployment], self.queued(deployment))
            n = sum(r.inflight for r in replicas if r.deployment == deployment)
            inflight.add_metric([deployment], n)
        yield q
        yield inflight
        tokens = GaugeMetricFamily(
            "hotpool_queued_prompt_tokens",
            "Prompt tokens replicas have still to compute (less their cached prefixes)",
            labels=["deployment"],
        )
        for deployment in deployments:
            n = sum(r.queued_tokens for r in replicas if r.deployment == deployment)
            tokens.add_metric([deployment], n)
        yield tokens
        routed = CounterMetricFamily(
            "hotpool_routing_decisions",
            "Requests routed among ready replicas, by why the replica won",
            labels=["deployment", "reason"],
        )
        for (deployment, reason), n in sorted(self.decisions().items()):
            routed.add_metric([deployment, reason], n)
        yield routed
        yield self._kv_cache_usage(replicas)
        yield from self._speculation()

    def _speculation(self) -> Iterator[GaugeMetricFamily]:
        # Gauges, not counters: a sum over live replicas drops when one drains.
        proposed = GaugeMetricFamily(
            "hotpool_spec_proposed_tokens",
            "Tokens speculative decoding proposed, summed over the deployment's ready replicas"
            " since each loaded",
            labels=["deployment"],
        )
        accepted = GaugeMetricFamily(
            "hotpool_spec_accepted_tokens",
            "Proposed tokens the model accepted, summed as hotpool_spec_proposed_tokens",
            labels=["deployment"],
        )
        rate = GaugeMetricFamily(
            "hotpool_spec_acceptance_ratio",
            "Accepted over proposed tokens on the deployment's ready replicas",
            labels=["deployment"],
        )
        enabled = GaugeMetricFamily(
            "hotpool_spec_enabled_replicas",
            "Ready replicas whose automatic switch has speculation on now (off under load)",
            labels=["deployment"],
        )
        for deployment, s in sorted(deployment_spec_stats(self.pool).items()):
            proposed.add_metric([deployment], s.proposed)
            accepted.add_metric([deployment], s.accepted)
            if s.acceptance_rate is not None:
                rate.add_metric([deployment], s.acceptance_rate)
            enabled.add_metric([deployment], s.enabled_replicas)
        yield from (proposed, accepted, rate, enabled)

    def _kv_cache_usage(self, replicas: list[Replica]) -> GaugeMetricFamily:
        # The max, not the mean: a replica about to preempt requests is what an operator needs
        # to see, and one idle replica next to a full one would hide it in a mean.
        kv = GaugeMetricFamily(
            "hotpool_kv_cache_usage_ratio",
            "Fraction of KV cache blocks in use, the highest of the deployment's ready"
            " replicas (as their workers last reported in a heartbeat)",
            labels=["deployment"],
        )
        highest: dict[str, float] = {}
        for r in replicas:
            usage = self._reported_kv_usage(r)
            if usage is not None:
                highest[r.deployment] = max(usage, highest.get(r.deployment, 0.0))
        for deployment in sorted(highest):
            kv.add_metric([deployment], highest[deployment])
        return kv

    def _reported_kv_usage(self, replica: Replica) -> float | None:
        """The latest heartbeat's KV usage of a ready replica's worker, if it sent one."""
        if replica.state is not ReplicaState.READY:
            return None
        # The registry, not `replica.worker`: that is the registration, never refreshed.
        worker = self.pool.registry.get(replica.handle.worker_id)
        return None if worker is None else worker.info.kv_cache_usage


class _LedgerCollector(Collector):
    """The ledger's write path: is the database taking records, does the spool hold any,
    how often did a write fail."""

    def __init__(self, writer: Callable[[], LedgerWriter | None]) -> None:
        self.writer = writer

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        writer = self.writer()
        if writer is None:
            return
        up = GaugeMetricFamily(
            "hotpool_ledger_database_up", "1 while usage records reach the database directly"
        )
        up.add_metric([], 1.0 if writer.database_up else 0.0)
        yield up
        pending = GaugeMetricFamily(
            "hotpool_ledger_spool_pending", "1 while spooled usage records wait for a replay"
        )
        pending.add_metric([], 1.0 if writer.spool_pending() else 0.0)
        yield pending
        spooled = CounterMetricFamily(
            "hotpool_ledger_spooled_records", "Usage records written to the spool (database down)"
        )
        spooled.add_metric([], writer.spooled)
        yield spooled
        size = GaugeMetricFamily(
            "hotpool_ledger_spool_bytes",
            "Bytes of spooled usage records waiting for a replay into the database",
        )
        size.add_metric([], spool_bytes(writer))
        yield size
        failures = CounterMetricFamily(
            "hotpool_ledger_write_failures",
            "Writes of usage records to the ledger database (batches, and spool replays)"
            " that failed or timed out; their records went to the spool or were retried",
        )
        failures.add_metric([], writer.failures)
        yield failures
        rejected = CounterMetricFamily(
            "hotpool_ledger_rejected_records",
            "Usage records the database refused on their own (kept in the spool's rejected"
            " file for an operator)",
        )
        rejected.add_metric([], writer.rejected)
        yield rejected


def spool_bytes(writer: LedgerWriter) -> int:
    """Size of the spool's usage files (the active one and sealed segments).

    Bytes rather than records: a count would mean reading every file at each scrape, or
    bookkeeping that a replay cut short by a crash gets wrong; a size is a few ``stat``s."""
    spool = writer.spool
    if spool is None:
        return 0
    total = 0
    # Sealed segments first: a replay sealing the active file between the two looks is then
    # missed once rather than counted twice.
    for path in (*spool.sealed(), spool.active):
        # A segment can vanish between the listing and the stat: the replay just removed it.
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


@dataclass(frozen=True, slots=True)
class _RequestChildren:
    """The labelled series one finished request updates."""

    requests: Counter
    input: Counter
    cached_input: Counter
    output: Counter
    ttft: Histogram
    e2e: Histogram
    queue: Histogram


def _request_children(
    m: Metrics, deployment: str, version: int | None, status: str
) -> _RequestChildren:
    v = "" if version is None else str(version)
    return _RequestChildren(
        requests=m.requests.labels(deployment, v, status),
        input=m.tokens.labels(deployment, v, "input"),
        cached_input=m.tokens.labels(deployment, v, "cached_input"),
        output=m.tokens.labels(deployment, v, "output"),
        ttft=m.ttft.labels(deployment, v),
        e2e=m.e2e.labels(deployment),
        queue=m.queue.labels(deployment),
    )


class Metrics:
    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # `version`: the deployment version that served (a canary runs next to the stable
        # one); bounded, as a deployment has one or two live versions at a time.
        self.requests = Counter(
            "hotpool_requests",
            "Requests by outcome and serving version",
            ["deployment", "version", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "hotpool_tokens",
            "Tokens metered, by kind (input, cached_input, output) and serving version",
            ["deployment", "version", "kind"],
            registry=r,
        )
        self.ttft = Histogram(
            "hotpool_time_to_first_token_seconds",
            "Time to first token, by serving version",
            ["deployment", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "hotpool_request_duration_seconds",
            "End-to-end request time",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "hotpool_inter_token_latency_seconds",
            "Time between consecutive output tokens of a choice, as they reach the control"
            " plane (tokens that arrive together share the gap)",
            ["deployment"],
            buckets=INTER_TOKEN_BUCKETS,
            registry=r,
        )
        self._inter_token: dict[str, Histogram] = {}  # its children, by deployment
        self._request_children: dict[tuple[str, int | None, str], _RequestChildren] = {}
        self.queue = Histogram(
            "hotpool_queue_seconds",
            "Time waiting for a replica",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cold_start = Histogram(
            "hotpool_cold_start_seconds", "Cold-start time by phase (total = whole cold start)",
            ["deployment", "phase"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.scale_events = Counter(
            "hotpool_scale_events", "Replicas added (up) and removed (down)",
            ["deployment", "direction"], registry=r,
        )  # fmt: skip
        self.queued: Callable[[str], int] = lambda deployment: 0  # set to the router's
        self.routing_decisions: Callable[[], Mapping[tuple[str, str], int]] = dict  # and these
        r.register(_PoolCollector(pool, lambda d: self.queued(d), lambda: self.routing_decisions()))
        self.ledger_writer: LedgerWriter | None = None  # set once the app has built it
        r.register(_LedgerCollector(lambda: self.ledger_writer))

    def observe_request(
        self,
        deployment: str,
        status: str,
        usage: Usage,
        ttft: float | None,
        total: float,
        queue: float | None,
        version: int | None = None,
    ) -> None:
        key = (deployment, version, status)
        c = self._request_children.get(key)
        if c is None:  # labels() costs more than the update: once per label set
            c = self._request_children[key] = _request_children(self, *key)
        c.requests.inc()
        c.input.inc(usage.prompt_tokens)
        c.cached_input.inc(usage.cached_tokens)
        c.output.inc(usage.completion_tokens)
        if ttft is not None:
            c.ttft.observe(ttft)
        c.e2e.observe(total)
        if queue is not None:
            c.queue.observe(queue)

    def observe_token_gap(self, deployment: str, seconds: float, tokens: int) -> None:
        """``tokens`` tokens arrived ``seconds`` after the choice's previous ones.

        Each gets an equal share, so the histogram's sum is the decode time and its count
        the tokens after each choice's first: sum / count is the mean inter-token latency."""
        child = self._inter_token.get(deployment)
        if child is None:  # labels() costs more than the observation, once per token
            child = self._inter_token[deployment] = self.inter_token.labels(deployment)
        for _ in range(tokens):
            child.observe(seconds / tokens)

    def observe_scale(self, event: ScaleEvent) -> None:
        direction = "up" if event.to_replicas > event.from_replicas else "down"
        self.scale_events.labels(event.deployment, direction).inc()

    def observe_cold_start(self, replica: Replica) -> None:
        if replica.load is None or replica.cold_start_seconds is None:
            return
        for phase, seconds in replica.load.phases.items():
            self.cold_start.labels(replica.deployment, phase).observe(seconds)
        self.cold_start.labels(replica.deployment, "total").observe(replica.cold_start_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
