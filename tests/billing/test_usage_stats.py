"""Requests by status, latency percentiles and last requests over the ledger, on SQLite and
PostgreSQL, checked against the same numbers computed in Python."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

import pytest

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import STATUSES, UsageEvent
from hotpool.billing.scale_events import ScaleEventRecord, ScaleEventStore
from hotpool.billing.tenants import TenantStore
from hotpool.billing.usage_stats import deployment_stats, percentile, requests_by_status

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(q * len(ordered)) - 1]


def _record(
    i: int,
    deployment: str,
    status: str = "completed",
    *,
    at: datetime = T0,
    ttft: float | None = 0.1,
    total: float | None = 1.0,
    tenant_id: int = 1,
) -> UsageRecord:
    return UsageRecord(
        f"req-{deployment}-{i}",
        deployment,
        "completions",
        status,
        10,
        5,
        tenant_id=tenant_id,
        ttft_seconds=ttft,
        total_seconds=total,
        created_at=at,
    )


def test_percentiles_match_nearest_rank_and_skip_untimed_requests(db: Database) -> None:
    rng = random.Random(7)
    ttfts = [round(rng.uniform(0.01, 3.0), 4) for _ in range(37)]
    recs = [_record(i, "a", ttft=t, at=T0 + timedelta(seconds=i)) for i, t in enumerate(ttfts)]
    # An error before the first token has no TTFT: it must not count as a zero.
    recs.append(_record(99, "a", "error", ttft=None, at=T0 + timedelta(seconds=50)))
    Ledger(db).record_many(recs)
    end = T0 + timedelta(hours=1)
    for q in (0.5, 0.95, 1.0):
        got = percentile(db, UsageEvent.ttft_seconds, q, T0, end, deployment="a")
        assert got == pytest.approx(_nearest_rank(ttfts, q))
    assert percentile(db, UsageEvent.ttft_seconds, 0.5, T0, end, deployment="b") is None
    # The range is [start, end): the first request alone is outside a range starting 1 s on.
    later = percentile(db, UsageEvent.ttft_seconds, 0.001, T0 + timedelta(seconds=1), end,
                       deployment="a")  # fmt: skip
    assert later == pytest.approx(min(ttfts[1:]))


def test_requests_by_status_per_deployment_and_tenant(db: Database) -> None:
    beta = TenantStore(db).create("beta")
    statuses = ["completed"] * 5 + ["partial"] * 2 + ["error"] + ["cancelled"] * 3
    recs = [_record(i, "a", s) for i, s in enumerate(statuses)]
    recs += [_record(i, "b", "error", tenant_id=beta.id) for i in range(4)]
    recs.append(_record(50, "a", at=T0 - timedelta(days=2)))  # before the range
    Ledger(db).record_many(recs)
    end = T0 + timedelta(hours=1)
    counts = requests_by_status(db, T0, end)
    assert counts == {
        "a": {"completed": 5, "partial": 2, "error": 1, "cancelled": 3},
        "b": dict.fromkeys(STATUSES, 0) | {"error": 4},
    }
    assert set(requests_by_status(db, T0, end, tenant_id=beta.id)) == {"b"}


def test_deployment_stats_include_idle_deployments_with_their_last_request(db: Database) -> None:
    Ledger(db).record_many(
        [
            _record(1, "busy", ttft=0.2, total=2.0, at=T0 + timedelta(minutes=5)),
            _record(2, "busy", ttft=0.4, total=4.0, at=T0 + timedelta(minutes=6)),
            _record(3, "idle", at=T0 - timedelta(days=3)),
        ]
    )
    stats = {s.deployment: s for s in deployment_stats(db, T0, T0 + timedelta(hours=1))}
    busy, idle = stats["busy"], stats["idle"]
    assert (busy.ttft_p50, busy.ttft_p95, busy.total_p50, busy.total_p95) == (0.2, 0.4, 2.0, 4.0)
    assert busy.requests["completed"] == 2
    assert busy.last_request_at == T0 + timedelta(minutes=6)
    # Nothing in range, but it exists in the ledger: counts are zero, the last use is kept.
    assert idle.requests == dict.fromkeys(STATUSES, 0)
    assert idle.ttft_p50 is None
    assert idle.last_request_at == T0 - timedelta(days=3)


def test_scale_events_between_keep_tenant_and_phases(db: Database) -> None:
    store = ScaleEventStore(db)
    up = store.record(ScaleEventRecord("a", 0, 1, "queued", created_at=T0, tenant_id=1))
    store.set_cold_start(up, 1.25, phases={"fetch": 0.5, "load": 0.6, "warmup": 0.15})
    store.record(ScaleEventRecord("b", 0, 1, "queued", created_at=T0, tenant_id=2))
    store.record(ScaleEventRecord("a", 1, 0, "idle", created_at=T0 + timedelta(hours=2),
                                  tenant_id=1))  # fmt: skip
    [event] = store.between(T0, T0 + timedelta(hours=1), tenant_id=1)
    assert (event.cold_start_seconds, event.tenant_id) == (1.25, 1)
    assert event.phases == {"fetch": 0.5, "load": 0.6, "warmup": 0.15}
    everyone = store.between(T0, T0 + timedelta(hours=3))
    assert [(e.deployment, e.to_replicas) for e in everyone] == [("a", 1), ("b", 1), ("a", 0)]
    # The latest ones when there are more than the limit, still oldest first.
    assert [e.to_replicas for e in store.between(T0, T0 + timedelta(hours=3), limit=2)] == [1, 0]
    with pytest.raises(ValueError, match="phase"):
        store.set_cold_start(up, 1.0, phases={"fetch": -1.0})
