from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest

from hotpool.billing.db import Database
from hotpool.billing.deployments import (
    DeploymentExists,
    DeploymentNotFound,
    DeploymentSpec,
    DeploymentStore,
)
from hotpool.billing.ledger import Ledger, UsageRecord


def _spec(name: str = "smollm2", **overrides: Any) -> DeploymentSpec:
    return DeploymentSpec(name=name, snapshot_uri=f"file:///snapshots/{name}", **overrides)


def test_create_then_get_returns_the_spec_with_created_at(db: Database) -> None:
    store = DeploymentStore(db)
    before = datetime.now(UTC)
    created = store.create(_spec(min_replicas=1, max_replicas=4, idle_timeout_s=60.5))
    assert created.created_at is not None
    assert created.created_at.tzinfo is UTC
    assert before <= created.created_at <= datetime.now(UTC)
    got = store.get("smollm2")
    assert got == created
    assert (got.min_replicas, got.max_replicas, got.target_concurrency) == (1, 4, 8)
    assert got.idle_timeout_s == 60.5
    assert got.tenant_id == 1


def test_get_of_unknown_name_is_none(db: Database) -> None:
    assert DeploymentStore(db).get("nope") is None


def test_duplicate_name_raises_deployment_exists(db: Database) -> None:
    store = DeploymentStore(db)
    store.create(_spec())
    with pytest.raises(DeploymentExists, match="'smollm2' already exists"):
        store.create(_spec(max_replicas=2))
    assert store.get("smollm2").max_replicas == 1  # type: ignore[union-attr]


def test_concurrent_creates_of_one_name_let_exactly_one_win(db: Database) -> None:
    store = DeploymentStore(db)
    barrier = threading.Barrier(8)

    def create(i: int) -> str:
        barrier.wait()
        try:
            store.create(_spec(max_replicas=i + 1))
        except DeploymentExists:
            return "exists"
        return "created"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(create, range(8)))
    assert sorted(outcomes) == ["created"] + ["exists"] * 7
    assert len(store.list()) == 1


def test_list_is_sorted_by_name(db: Database) -> None:
    store = DeploymentStore(db)
    for name in ("beta", "alpha", "gamma"):
        store.create(_spec(name))
    assert [s.name for s in store.list()] == ["alpha", "beta", "gamma"]


def test_upsert_creates_then_replaces_settings_keeping_created_at(db: Database) -> None:
    store = DeploymentStore(db)
    first = store.upsert(_spec(max_replicas=2))
    assert store.get("smollm2") == first
    second = store.upsert(
        DeploymentSpec("smollm2", "s3://bucket/v2", min_replicas=1, max_replicas=3)
    )
    assert second.created_at == first.created_at
    assert (second.snapshot_uri, second.min_replicas, second.max_replicas) == (
        "s3://bucket/v2",
        1,
        3,
    )
    assert store.get("smollm2") == second
    assert len(store.list()) == 1


def test_delete_removes_it_and_keeps_its_usage(db: Database) -> None:
    store, ledger = DeploymentStore(db), Ledger(db)
    store.create(_spec())
    ledger.record(UsageRecord("req-1", "smollm2", "completions", "completed", 3, 4))
    store.delete("smollm2")
    assert store.get("smollm2") is None
    assert [r.deployment for r in ledger.events()] == ["smollm2"]
    store.create(_spec())  # the name is free again


def test_delete_of_unknown_name_raises_not_found(db: Database) -> None:
    with pytest.raises(DeploymentNotFound, match="'nope' not found"):
        DeploymentStore(db).delete("nope")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"name": ""}, "name must be 1 to 128 characters"),
        ({"snapshot_uri": ""}, "snapshot_uri must not be empty"),
        ({"min_replicas": -1}, "min_replicas must be >= 0"),
        ({"max_replicas": 0}, "max_replicas must be >= 1"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas must be >= 1 and >= min_replicas"),
        ({"target_concurrency": 0}, "target_concurrency must be >= 1"),
        ({"idle_timeout_s": -1.0}, "idle_timeout_s must be a finite number >= 0"),
        ({"idle_timeout_s": float("inf")}, "idle_timeout_s must be a finite number >= 0"),
        ({"max_replicas": 2.5}, "max_replicas must be an integer"),
    ],
)
def test_invalid_specs_are_rejected(overrides: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"name": "m", "snapshot_uri": "file:///m", **overrides}
    with pytest.raises(ValueError, match=message):
        DeploymentSpec(**fields)
