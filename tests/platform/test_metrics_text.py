"""The control plane's /metrics text: names as DESIGN.md sets them, bounded labels, and
the series issue 9 added (inter-token latency, KV cache usage from heartbeats, ledger write
failures and spool size), in one event loop with stand-in workers (milliseconds)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from grafana_board import exposed_series, load_board, queried_metrics
from instant_workers import InstantBackend
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.exc import OperationalError

from hotpool.billing.db import Database
from hotpool.billing.deployments import DeploymentSpec
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.platform.invoke import _Tally, _tally_event, _token_gap
from hotpool.platform.ledger_writer import LedgerWriter
from hotpool.platform.metrics import INTER_TOKEN_BUCKETS, Metrics
from hotpool.pool.pool import WorkerPool
from hotpool.pool.registry import WorkerRegistry
from hotpool.pool.replica import Replica, ReplicaState
from hotpool.worker.protocol import GenerateEvent, LoadResult, Usage, WorkerInfo

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
# `version`: a deployment version (one or two live at a time), never a request id.
BOUNDED_LABELS = {"deployment", "version", "status", "kind", "phase", "state", "direction", "le"}


def _worker_api(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/load":
        phases = {"fetch": 0.5, "load": 1.5, "warmup": 0.25}
        return httpx.Response(200, json=LoadResult("d", "sha", True, phases, "disk").to_json())
    return httpx.Response(200, json={"status": "unloaded"})


def _pool() -> WorkerPool:
    registry = WorkerRegistry()
    pool = WorkerPool(InstantBackend(registry), registry, "t", max_workers=3, start_timeout_s=5)
    pool.launcher.client = httpx.AsyncClient(transport=httpx.MockTransport(_worker_api))
    return pool


async def _ready(pool: WorkerPool, deployment: str) -> Replica:
    replica = pool.scale_up(DeploymentSpec(name=deployment, snapshot_uri=f"file:///{deployment}"))
    await asyncio.wait_for(replica.ready.wait(), 5)
    assert replica.state is ReplicaState.READY, replica.error
    return replica


def _heartbeat(pool: WorkerPool, replica: Replica, kv_cache_usage: float | None) -> None:
    assert replica.worker is not None
    info = WorkerInfo.from_json({**replica.worker.to_json(), "kv_cache_usage": kv_cache_usage})
    pool.registry.heartbeat(info)


def _samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 20))


# -- inter-token latency ------------------------------------------------------------------


def test_token_gaps_are_measured_per_choice() -> None:
    t = _Tally(n=2)
    events = [  # (arrival time, event): the two choices interleave
        (1.0, GenerateEvent("a", (1,), index=0)),
        (1.1, GenerateEvent("b", (2,), index=1)),
        (1.3, GenerateEvent("c", (3,), index=0)),
        (1.4, GenerateEvent("", (), index=0)),  # no token: no gap, the clock keeps running
        (1.7, GenerateEvent("de", (4, 5), "length", Usage(3, 5), index=0)),
        (1.9, GenerateEvent("f", (6,), "length", Usage(3, 6), index=1)),
    ]
    gaps = []
    for now, event in events:
        _tally_event(t, event, now)
        gaps.append(_token_gap(t, event, now))
    assert gaps == [None, None, pytest.approx(0.3), None, pytest.approx(0.4), pytest.approx(0.8)]
    assert t.ttft == pytest.approx(1.0 - t.t0)  # the first token of any choice


def test_tokens_that_arrive_together_share_their_gap() -> None:
    metrics = Metrics(_pool())
    metrics.observe_token_gap("a", 0.06, 3)  # three tokens held back by the detokenizer
    metrics.observe_token_gap("a", 0.02, 1)
    s = _samples(metrics.render().decode())
    assert _value(s, "hotpool_inter_token_latency_seconds_count", deployment="a") == 4
    assert _value(s, "hotpool_inter_token_latency_seconds_sum", deployment="a") == pytest.approx(
        0.08
    )  # the decode time: sum / count is the mean inter-token latency
    le = {k[1]: v for k, v in s.items() if k[0] == "hotpool_inter_token_latency_seconds_bucket"}
    assert le[frozenset({("deployment", "a"), ("le", "0.02")})] == 4
    assert le[frozenset({("deployment", "a"), ("le", "0.015")})] == 0
    assert INTER_TOKEN_BUCKETS[0] == 0.001 and INTER_TOKEN_BUCKETS[-1] == 2.5


# -- KV cache usage -------------------------------------------------------------------------


def test_kv_cache_usage_is_the_highest_reported_by_ready_replicas() -> None:
    async def scenario() -> None:
        pool = _pool()
        metrics = Metrics(pool)
        a1, a2, b = [await _ready(pool, d) for d in ("a", "a", "b")]
        s = _samples(metrics.render().decode())
        assert _value(s, "hotpool_kv_cache_usage_ratio", deployment="a") is None  # no report yet

        _heartbeat(pool, a1, 0.25)
        _heartbeat(pool, a2, 0.75)
        _heartbeat(pool, b, None)  # a worker of an older version, or with nothing loaded
        s = _samples(metrics.render().decode())
        assert _value(s, "hotpool_kv_cache_usage_ratio", deployment="a") == 0.75
        assert _value(s, "hotpool_kv_cache_usage_ratio", deployment="b") is None

        a2.state = ReplicaState.DRAINING  # leaving: its cache says nothing of the capacity left
        s = _samples(metrics.render().decode())
        assert _value(s, "hotpool_kv_cache_usage_ratio", deployment="a") == 0.25
        await pool.shutdown()

    run(scenario)


def test_worker_info_carries_kv_usage_and_old_payloads_still_parse() -> None:
    old = {"worker_id": "w", "address": "http://w", "pid": 1, "device": "cpu", "memory_bytes": 1}
    assert WorkerInfo.from_json(old).kv_cache_usage is None
    info = WorkerInfo.from_json({**old, "loaded": "a", "kv_cache_usage": 0.5})
    assert WorkerInfo.from_json(info.to_json()) == info
    assert WorkerInfo.from_json({**old, "kv_cache_usage": 1}).kv_cache_usage == 1
    for bad in ("0.5", True, [0.5]):
        with pytest.raises(TypeError, match="kv_cache_usage"):
            WorkerInfo.from_json({**old, "kv_cache_usage": bad})


# -- the ledger's write path ------------------------------------------------------------------


class DownLedger(Ledger):
    """A ledger whose database refuses every connection."""

    def record_many(self, recs: Any) -> int:
        raise OperationalError("INSERT", {}, ConnectionRefusedError("database is down"))


def _rec(request_id: str, **overrides: Any) -> UsageRecord:
    fields: dict[str, Any] = {
        "request_id": request_id, "deployment": "a", "endpoint": "completions",
        "status": "completed", "prompt_tokens": 5, "completion_tokens": 3,
        "created_at": datetime(2025, 3, 1, tzinfo=UTC),
    }  # fmt: skip
    return UsageRecord(**{**fields, **overrides})


def _ledger_samples(metrics: Metrics) -> Samples:
    return {k: v for k, v in _samples(metrics.render().decode()).items() if "ledger" in k[0]}


def test_failed_writes_count_and_the_spool_reports_its_size(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'ledger.db'}")
    db.upgrade()

    async def scenario() -> None:
        metrics = Metrics(_pool())
        writer = LedgerWriter(DownLedger(db), tmp_path / "spool", max_backoff_s=60)
        metrics.ledger_writer = writer
        assert _ledger_samples(metrics)[("hotpool_ledger_spool_bytes", frozenset())] == 0
        await writer.start()
        for i in range(3):
            writer.submit(_rec(f"r{i}"))
        await writer.flush()
        s = _ledger_samples(metrics)
        assert s[("hotpool_ledger_database_up", frozenset())] == 0
        assert s[("hotpool_ledger_write_failures_total", frozenset())] >= 1
        assert s[("hotpool_ledger_spooled_records_total", frozenset())] == 3
        size = sum(p.stat().st_size for p in (tmp_path / "spool").glob("usage*.jsonl"))
        assert s[("hotpool_ledger_spool_bytes", frozenset())] == size > 0
        assert s[("hotpool_ledger_spool_pending", frozenset())] == 1
        await writer.close()

    try:
        run(scenario)
    finally:
        db.dispose()


def test_records_the_database_refuses_are_counted(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'ledger.db'}")
    db.upgrade()

    async def scenario() -> None:
        metrics = Metrics(_pool())
        writer = LedgerWriter(Ledger(db), tmp_path / "spool")
        metrics.ledger_writer = writer
        await writer.start()
        for rec in (_rec("ok"), _rec("bad", tenant_id=999)):  # no tenant 999: a foreign key
            writer.submit(rec)
        await writer.close()
        s = _ledger_samples(metrics)
        assert s[("hotpool_ledger_rejected_records_total", frozenset())] == 1
        assert s[("hotpool_ledger_write_failures_total", frozenset())] == 0  # the database is up
        assert s[("hotpool_ledger_database_up", frozenset())] == 1

    try:
        run(scenario)
    finally:
        db.dispose()


# -- the whole text ---------------------------------------------------------------------------


async def _after_a_request() -> tuple[WorkerPool, str]:
    """A ready replica of `a` (cold start, scale event, heartbeat) that served one request,
    and the /metrics text then: every series the control plane has."""
    pool = _pool()
    metrics = Metrics(pool)
    metrics.ledger_writer = LedgerWriter(Ledger(Database("sqlite://")))
    pool.on_scale = metrics.observe_scale
    replica = await _ready(pool, "a")
    metrics.observe_cold_start(replica)
    _heartbeat(pool, replica, 0.5)
    metrics.observe_request("a", "completed", Usage(7, 4, 2), 0.3, 0.9, 0.01)
    metrics.observe_token_gap("a", 0.05, 1)
    return pool, metrics.render().decode()


def test_the_grafana_board_queries_only_series_the_control_plane_has() -> None:
    async def scenario() -> None:
        pool, text = await _after_a_request()
        missing = queried_metrics(load_board()) - exposed_series(text)
        assert not missing, f"the board queries series /metrics does not have: {missing}"
        await pool.shutdown()

    run(scenario)


def test_every_series_follows_the_naming_rules() -> None:
    async def scenario() -> None:
        pool, text = await _after_a_request()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name, family in families.items():
            assert name.startswith("hotpool_"), name
            for sample in family.samples:
                assert set(sample.labels) <= BOUNDED_LABELS, sample  # never a request id
                if family.type == "counter":
                    assert sample.name == f"{name}_total", sample
        for name in ("hotpool_time_to_first_token_seconds", "hotpool_request_duration_seconds",
                     "hotpool_queue_seconds", "hotpool_cold_start_seconds",
                     "hotpool_inter_token_latency_seconds"):  # fmt: skip
            assert families[name].type == "histogram", name
        for name in ("hotpool_kv_cache_usage_ratio", "hotpool_ledger_spool_bytes"):
            assert families[name].type == "gauge", name
        for name in ("hotpool_ledger_write_failures", "hotpool_ledger_rejected_records"):
            assert families[name].type == "counter", name
        s = _samples(text)
        assert (
            _value(s, "hotpool_tokens_total", deployment="a", kind="cached_input", version="") == 2
        )
        assert _value(s, "hotpool_cold_start_seconds_sum", deployment="a", phase="load") == 1.5
        assert _value(s, "hotpool_kv_cache_usage_ratio", deployment="a") == 0.5
        await pool.shutdown()

    run(scenario)
