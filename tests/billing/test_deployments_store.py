from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select

from hotpool.billing.db import Database
from hotpool.billing.deployments import (
    DeploymentExists,
    DeploymentNotFound,
    DeploymentSpec,
    DeploymentStore,
    runs_differently,
)
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import Deployment

MiB = 1 << 20


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
        ({"max_queue": 0}, "max_queue must be an integer >= 1 or None"),
        ({"max_queue": True}, "max_queue must be an integer >= 1 or None"),
        ({"queue_timeout_s": 0}, "queue_timeout_s must be a finite number > 0 or None"),
        ({"queue_timeout_s": float("nan")}, "queue_timeout_s must be a finite number > 0"),
        ({"queue_timeout_s": "5"}, "queue_timeout_s must be a finite number > 0"),
        ({"dtype": "int8"}, "dtype must be one of bf16, fp16, fp32 or None"),
        ({"dtype": "BF16"}, "dtype must be one of bf16, fp16, fp32 or None"),
        ({"quantization": "int4"}, "quantization must be one of none, int8, gguf, got 'int4'"),
        ({"quantization": None}, "quantization must be one of none, int8, gguf"),
        ({"max_model_len": 15}, "max_model_len must be an integer >= 16 or None"),
        ({"max_model_len": 2048.0}, "max_model_len must be an integer >= 16 or None"),
        ({"kv_cache_bytes": MiB - 1}, "kv_cache_bytes must be an integer >= 1048576 or None"),
        ({"generation": 0}, "generation must be an integer >= 1"),
    ],
)
def test_invalid_specs_are_rejected(overrides: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"name": "m", "snapshot_uri": "file:///m", **overrides}
    with pytest.raises(ValueError, match=message):
        DeploymentSpec(**fields)


def _updated_at(db: Database, name: str) -> datetime:
    with db.session() as session:
        return session.scalars(select(Deployment.updated_at).where(Deployment.name == name)).one()


def test_new_settings_default_to_none_and_generation_one(db: Database) -> None:
    created = DeploymentStore(db).create(_spec())
    assert (
        created.max_queue,
        created.queue_timeout_s,
        created.dtype,
        created.max_model_len,
        created.kv_cache_bytes,
    ) == (None, None, None, None, None)
    assert created.quantization == "none"  # weights in the activation dtype
    assert created.generation == 1
    assert DeploymentStore(db).get("smollm2") == created


def test_every_field_round_trips(db: Database) -> None:
    store = DeploymentStore(db)
    spec = DeploymentSpec(
        name="full",
        snapshot_uri="s3://bucket/full",
        min_replicas=1,
        max_replicas=3,
        target_concurrency=16,
        idle_timeout_s=120.25,
        max_queue=64,
        queue_timeout_s=2.5,
        dtype="fp16",
        quantization="int8",
        max_model_len=4096,
        kv_cache_bytes=80 << 30,  # beyond a 32-bit integer
    )
    created = store.create(spec)
    assert created == replace(spec, created_at=created.created_at)
    assert store.get("full") == created
    assert store.list() == [created]
    assert isinstance(created.queue_timeout_s, float)


def test_the_store_sets_generation_not_the_written_spec(db: Database) -> None:
    assert DeploymentStore(db).create(_spec(generation=7)).generation == 1


def test_runs_differently_only_for_what_replicas_load() -> None:
    old = _spec()
    for scaling in (
        {"min_replicas": 1, "max_replicas": 2},
        {"target_concurrency": 2},
        {"idle_timeout_s": 5.0},
        {"max_queue": 3},
        {"queue_timeout_s": 1.0},
    ):
        assert not runs_differently(old, replace(old, **scaling))
    for loading in (
        {"snapshot_uri": "s3://b/v2"},
        {"dtype": "bf16"},
        {"quantization": "int8"},
        {"quantization": "gguf"},
        {"max_model_len": 512},
        {"kv_cache_bytes": 8 * MiB},
    ):
        assert runs_differently(old, replace(old, **loading))


def test_update_of_scaling_and_queue_settings_keeps_the_generation(db: Database) -> None:
    store = DeploymentStore(db)
    created = store.create(_spec(dtype="bf16"))
    before = _updated_at(db, "smollm2")
    updated = store.update(
        "smollm2",
        min_replicas=1,
        max_replicas=4,
        target_concurrency=2,
        idle_timeout_s=30,
        max_queue=10,
        queue_timeout_s=1.5,
    )
    assert updated == replace(
        created,
        min_replicas=1,
        max_replicas=4,
        target_concurrency=2,
        idle_timeout_s=30.0,
        max_queue=10,
        queue_timeout_s=1.5,
    )
    assert updated.generation == 1
    assert store.get("smollm2") == updated
    assert _updated_at(db, "smollm2") > before
    # Back to the server's defaults.
    reset = store.update("smollm2", max_queue=None, queue_timeout_s=None)
    assert (reset.max_queue, reset.queue_timeout_s, reset.generation) == (None, None, 1)


@pytest.mark.parametrize(
    "change",
    [
        {"snapshot_uri": "s3://bucket/v2"},
        {"dtype": "fp32"},
        {"dtype": None},  # back to the snapshot's own
        {"quantization": "int8"},
        {"max_model_len": 1024},
        {"kv_cache_bytes": 512 * MiB},
        {"max_replicas": 2, "max_model_len": 16},  # one bump for the whole update
    ],
)
def test_update_of_what_replicas_load_bumps_the_generation(
    db: Database, change: dict[str, Any]
) -> None:
    store = DeploymentStore(db)
    store.create(_spec(dtype="bf16", max_model_len=2048))
    updated = store.update("smollm2", **change)
    assert updated.generation == 2
    for field, value in change.items():
        assert getattr(updated, field) == value
    assert store.get("smollm2") == updated
    # Setting the same value again changes nothing replicas run.
    assert store.update("smollm2", **change).generation == 2


def test_update_of_an_unknown_deployment_raises_not_found(db: Database) -> None:
    with pytest.raises(DeploymentNotFound, match="'nope' not found"):
        DeploymentStore(db).update("nope", max_replicas=2)


@pytest.mark.parametrize(
    "change",
    [{"colour": "blue"}, {"name": "other"}, {"tenant_id": 2}, {"generation": 5}],
)
def test_update_of_a_field_it_cannot_change_raises_type_error(
    db: Database, change: dict[str, Any]
) -> None:
    store = DeploymentStore(db)
    created = store.create(_spec())
    with pytest.raises(TypeError, match=f"cannot update '{next(iter(change))}'"):
        store.update("smollm2", **change)
    assert store.get("smollm2") == created


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"min_replicas": 5}, "max_replicas must be >= 1 and >= min_replicas"),
        ({"max_replicas": 1, "min_replicas": 2}, "max_replicas must be >= 1 and >= min_replicas"),
        ({"dtype": "int4", "max_replicas": 8}, "dtype must be one of"),
        ({"quantization": "fp8", "max_replicas": 8}, "quantization must be one of"),
        ({"snapshot_uri": ""}, "snapshot_uri must not be empty"),
    ],
)
def test_update_with_an_invalid_result_writes_nothing(
    db: Database, change: dict[str, Any], message: str
) -> None:
    store = DeploymentStore(db)
    created = store.create(_spec(max_replicas=4))
    with pytest.raises(ValueError, match=message):
        store.update("smollm2", **change)
    assert store.get("smollm2") == created


def test_concurrent_updates_each_apply_to_the_latest_row(db: Database) -> None:
    store = DeploymentStore(db)
    store.create(_spec(max_replicas=1))
    n = 12
    barrier = threading.Barrier(n)

    def update(i: int) -> tuple[bool, int]:
        barrier.wait()
        if i % 3 == 0:  # scaling only: no new generation
            return False, store.update("smollm2", max_replicas=i + 2).generation
        # A distinct value each time, so every one of these needs new replicas.
        return True, store.update("smollm2", kv_cache_bytes=(i + 1) * MiB).generation

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(update, range(n)))
    bumping = sorted(generation for bumps, generation in results if bumps)
    assert len(bumping) == 8
    # Each bump saw the one before it: none was lost to a stale read.
    assert bumping == list(range(2, 2 + len(bumping)))
    final = store.get("smollm2")
    assert final is not None
    assert final.generation == 1 + len(bumping)


def test_upsert_carries_the_new_fields_and_bumps_generation_on_a_new_snapshot(
    db: Database,
) -> None:
    store = DeploymentStore(db)
    first = store.upsert(_spec(max_queue=5, dtype="fp16", kv_cache_bytes=64 * MiB))
    assert (first.max_queue, first.dtype, first.kv_cache_bytes, first.generation) == (
        5,
        "fp16",
        64 * MiB,
        1,
    )
    scaled = store.upsert(_spec(max_queue=9, dtype="fp16", kv_cache_bytes=64 * MiB))
    assert (scaled.max_queue, scaled.generation) == (9, 1)
    reloaded = store.upsert(_spec(max_queue=9, kv_cache_bytes=64 * MiB))  # dtype back to None
    assert (reloaded.dtype, reloaded.generation) == (None, 2)
    assert store.get("smollm2") == reloaded
