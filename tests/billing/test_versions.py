"""Deployment versions in the store: numbering, canary, promote, rollback, and usage per
version, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from hotpool.billing.db import Database
from hotpool.billing.deployments import (
    DeploymentNotFound,
    DeploymentSpec,
    DeploymentStore,
    VersionConflict,
    VersionNotFound,
)
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import DeploymentVersion
from hotpool.billing.usage import usage_buckets
from hotpool.billing.usage_stats import version_stats

T0 = datetime(2025, 7, 1, 9, 0, tzinfo=UTC)


def _store(db: Database) -> DeploymentStore:
    store = DeploymentStore(db)
    store.create(DeploymentSpec("chat", "file:///snap/v1", max_replicas=3), created_by="hp_alice")
    return store


def test_each_change_of_what_replicas_run_is_a_new_numbered_version(db: Database) -> None:
    store = _store(db)
    assert store.get("chat").generation == 1  # type: ignore[union-attr]
    store.update("chat", max_replicas=2)  # scaling: no new version
    spec = store.update("chat", snapshot_uri="file:///snap/v2", dtype="fp32", created_by="cli")
    assert (spec.generation, spec.previous_version) == (2, 1)
    [v1, v2] = store.versions("chat")
    assert (v1.version, v1.snapshot_uri, v1.created_by, v1.changes) == (
        1, "file:///snap/v1", "hp_alice", None
    )  # fmt: skip
    assert v2.changes == {"snapshot_uri": ["file:///snap/v1", "file:///snap/v2"],
                          "dtype": [None, "fp32"]}  # fmt: skip
    assert (v2.created_by, v2.dtype) == ("cli", "fp32")
    assert v2.created_at is not None and v2.created_at >= v1.created_at  # type: ignore[operator]
    assert store.version("chat", 2) == v2
    assert (v1.quantization, v2.quantization) == ("none", "none")
    spec = store.update("chat", quantization="int8")
    v3 = store.version("chat", 3)
    assert (spec.generation, v3.quantization) == (3, "int8")
    assert v3.changes == {"quantization": ["none", "int8"]}
    with pytest.raises(VersionNotFound, match="has no version 9"):
        store.version("chat", 9)
    with pytest.raises(DeploymentNotFound):
        store.versions("nope")


def test_a_canary_takes_a_share_and_leaves_the_stable_version_alone(db: Database) -> None:
    store = _store(db)
    spec = store.add_canary("chat", 20, created_by="hp_bob", snapshot_uri="file:///snap/v2")
    assert (spec.generation, spec.canary_version, spec.canary_percent) == (1, 2, 20.0)
    assert spec.snapshot_uri == "file:///snap/v1"  # the stable version's
    canary = spec.at_version(store.version("chat", 2))
    assert (canary.snapshot_uri, canary.generation, canary.canary_version) == (
        "file:///snap/v2", 2, None
    )  # fmt: skip
    # A scaling change keeps the canary; a stable roll-out numbers after the canary.
    assert store.update("chat", max_replicas=2).canary_version == 2
    spec = store.update("chat", kv_cache_bytes=1 << 30)
    assert (spec.generation, spec.canary_version) == (3, 2)
    assert store.set_canary("chat", 2, 50).canary_percent == 50.0
    assert store.set_canary("chat", None, None).canary_version is None


def test_a_canary_of_another_quantization_runs_it_until_a_rollback(db: Database) -> None:
    store = _store(db)
    spec = store.add_canary("chat", 10, quantization="int8")
    assert (spec.quantization, spec.canary_version) == ("none", 2)  # the stable one's
    assert spec.at_version(store.version("chat", 2)).quantization == "int8"
    assert store.promote("chat").quantization == "int8"
    assert store.rollback("chat").quantization == "none"


def test_invalid_canaries_are_refused_with_reasons(db: Database) -> None:
    store = _store(db)
    with pytest.raises(VersionConflict, match="would run what the stable version runs"):
        store.add_canary("chat", 5, snapshot_uri="file:///snap/v1")
    with pytest.raises(TypeError, match="a canary changes only"):
        store.add_canary("chat", 5, max_replicas=2)
    for bad in (-1, 100.5, float("nan"), True, "5"):
        with pytest.raises(ValueError, match="percent must be a number from 0 to 100"):
            store.add_canary("chat", bad, snapshot_uri="file:///snap/v2")  # type: ignore[arg-type]
    with pytest.raises(VersionNotFound):
        store.set_canary("chat", 7, 10)
    with pytest.raises(VersionConflict, match="is the stable version already"):
        store.set_canary("chat", 1, 10)
    with pytest.raises(VersionConflict, match="no canary to promote"):
        store.promote("chat")
    with pytest.raises(VersionConflict, match="no canary and no previous"):
        store.rollback("chat")
    with pytest.raises(DeploymentNotFound):
        store.add_canary("ghost", 5, snapshot_uri="file:///x")
    assert store.versions("chat")[-1].version == 1  # nothing was written


def test_promote_then_rollback_then_rollback_again(db: Database) -> None:
    store = _store(db)
    store.add_canary("chat", 10, snapshot_uri="file:///snap/v2")
    spec = store.promote("chat")
    assert (spec.generation, spec.previous_version, spec.canary_version) == (2, 1, None)
    assert spec.snapshot_uri == "file:///snap/v2"
    # During a canary, a rollback ends the canary; the stable version stays.
    store.add_canary("chat", 10, snapshot_uri="file:///snap/v3")
    spec = store.rollback("chat")
    assert (spec.generation, spec.canary_version) == (2, None)
    # Without one, it returns to the previous stable version (and again undoes that).
    spec = store.rollback("chat")
    assert (spec.generation, spec.previous_version, spec.snapshot_uri) == (1, 2, "file:///snap/v1")
    assert store.rollback("chat").generation == 2


def test_deleting_a_deployment_removes_its_versions(db: Database) -> None:
    store = _store(db)
    store.update("chat", snapshot_uri="file:///snap/v2")
    store.delete("chat")
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(DeploymentVersion)) == 0
    # The name starts afresh at version 1.
    store.create(DeploymentSpec("chat", "file:///snap/v9"))
    assert [v.version for v in store.versions("chat")] == [1]


def test_usage_and_latency_per_version(db: Database) -> None:
    ledger = Ledger(db)
    for i in range(10):
        ledger.record(
            UsageRecord(
                f"r{i}",
                "chat",
                "completions",
                "error" if i == 9 else "completed",
                10,
                1 + (i >= 8),
                version=1 + (i >= 8),
                ttft_seconds=0.1 * (1 + i),
                total_seconds=1.0,
                created_at=T0,
            )
        )
    rows = usage_buckets(db, T0, T0 + timedelta(hours=1), "1h", group_by=("version",))
    assert [(r.version, r.requests, r.completion_tokens) for r in rows] == [(1, 8, 8), (2, 2, 4)]
    stats = version_stats(db, T0, T0 + timedelta(hours=1), deployment="chat")
    assert [s.version for s in stats] == [1, 2]
    assert stats[1].requests == {"completed": 1, "partial": 0, "error": 1, "cancelled": 0}
    assert (stats[0].ttft_p50, stats[1].ttft_p95) == (pytest.approx(0.4), pytest.approx(1.0))
    assert (stats[0].prompt_tokens, stats[1].completion_tokens) == (80, 4)
    with pytest.raises(ValueError, match="version must be an integer"):
        UsageRecord("bad", "chat", "completions", "completed", 1, 1, version=0)
