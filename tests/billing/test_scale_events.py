from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import insert
from sqlalchemy.exc import IntegrityError

from hotpool.billing.db import Database
from hotpool.billing.deployments import DeploymentSpec, DeploymentStore
from hotpool.billing.models import ScaleEvent
from hotpool.billing.scale_events import ScaleEventRecord, ScaleEventStore

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _event(**overrides: Any) -> ScaleEventRecord:
    fields: dict[str, Any] = {
        "deployment": "smollm2",
        "from_replicas": 0,
        "to_replicas": 1,
        "reason": "1 request queued, no replica",
        "created_at": T0,
    }
    fields.update(overrides)
    return ScaleEventRecord(**fields)


def _url(db: Database) -> str:
    return db.url.render_as_string(hide_password=False)


def test_record_returns_ids_and_list_is_newest_first(db: Database) -> None:
    store = ScaleEventStore(db)
    up = _event(
        created_at=datetime(2025, 3, 1, 14, 0, 0, 250000, tzinfo=timezone(timedelta(hours=2)))
    )
    more = _event(from_replicas=1, to_replicas=3, reason="24 in flight, target 8")
    down = _event(from_replicas=3, to_replicas=0, reason="idle for 300s")
    ids = [store.record(ev) for ev in (up, more, down)]
    assert ids == sorted(ids) and len(set(ids)) == 3

    events = store.list()
    assert [ev.id for ev in events] == ids[::-1]
    assert [(ev.from_replicas, ev.to_replicas) for ev in events] == [(3, 0), (1, 3), (0, 1)]
    assert events[1].reason == "24 in flight, target 8"
    # Read back in UTC, whatever zone it was written in.
    assert events[2].created_at == datetime(2025, 3, 1, 12, 0, 0, 250000, tzinfo=UTC)
    assert events[2].created_at is not None and events[2].created_at.tzinfo is UTC
    assert events[2].cold_start_seconds is None and events[2].error is None


def test_created_at_defaults_to_now(db: Database) -> None:
    store = ScaleEventStore(db)
    before = datetime.now(UTC)
    store.record(_event(created_at=None))
    after = datetime.now(UTC)
    [back] = store.list()
    assert back.created_at is not None
    assert before <= back.created_at <= after


def test_list_filters_by_deployment_and_limit(db: Database) -> None:
    store = ScaleEventStore(db)
    a1 = store.record(_event(deployment="a"))
    store.record(_event(deployment="b"))
    a2 = store.record(_event(deployment="a", from_replicas=1, to_replicas=2))
    assert [ev.id for ev in store.list("a")] == [a2, a1]
    assert [ev.deployment for ev in store.list("b")] == ["b"]
    assert store.list("nope") == []
    assert [ev.id for ev in store.list("a", limit=1)] == [a2]
    assert store.list(limit=0) == []


def test_paging_with_before_id_visits_every_event_once(db: Database) -> None:
    store = ScaleEventStore(db)
    # Same created_at for all: paging must not depend on timestamps being distinct.
    ids = [store.record(_event(from_replicas=i, to_replicas=i + 1)) for i in range(7)]
    pages: list[list[int]] = []
    before: int | None = None
    while page := store.list(limit=3, before_id=before):
        pages.append([ev.id for ev in page if ev.id is not None])
        before = page[-1].id
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [i for p in pages for i in p] == ids[::-1]


def test_paging_combines_with_deployment_filter(db: Database) -> None:
    store = ScaleEventStore(db)
    ids = {name: [store.record(_event(deployment=name)) for _ in range(3)] for name in "ab"}
    last_b = ids["b"][-1]
    assert [ev.id for ev in store.list("a", before_id=last_b)] == ids["a"][::-1]
    assert [ev.id for ev in store.list("b", before_id=last_b)] == ids["b"][1::-1]


def test_set_cold_start_fills_in_duration_or_error(db: Database) -> None:
    store = ScaleEventStore(db)
    ok = store.record(_event(deployment="a"))
    failed = store.record(_event(deployment="b"))
    store.set_cold_start(ok, 4.25)
    store.set_cold_start(failed, 1.5, error="snapshot sha256 mismatch")
    by_id = {ev.id: ev for ev in store.list()}
    assert (by_id[ok].cold_start_seconds, by_id[ok].error) == (4.25, None)
    assert (by_id[failed].cold_start_seconds, by_id[failed].error) == (
        1.5,
        "snapshot sha256 mismatch",
    )
    # Other fields are untouched.
    assert by_id[ok].reason == _event().reason and by_id[ok].created_at == T0

    store.set_cold_start(failed, None, error="worker died while loading")
    [back] = store.list("b")
    assert (back.cold_start_seconds, back.error) == (None, "worker died while loading")


def test_set_cold_start_of_unknown_id_raises_key_error(db: Database) -> None:
    store = ScaleEventStore(db)
    known = store.record(_event())
    with pytest.raises(KeyError):
        store.set_cold_start(known + 1000, 2.0)
    [back] = store.list()
    assert back.cold_start_seconds is None


@pytest.mark.parametrize("seconds", [-0.1, math.nan, math.inf, True])
def test_set_cold_start_rejects_bad_durations(db: Database, seconds: Any) -> None:
    store = ScaleEventStore(db)
    event_id = store.record(_event())
    with pytest.raises(ValueError, match="cold_start_seconds"):
        store.set_cold_start(event_id, seconds)
    [back] = store.list()
    assert back.cold_start_seconds is None


def test_events_survive_a_new_database_object(db: Database) -> None:
    ScaleEventStore(db).record(_event(cold_start_seconds=3.0))
    db.dispose()
    reopened = Database(_url(db))
    try:
        [back] = ScaleEventStore(reopened).list()
        assert (back.deployment, back.to_replicas, back.cold_start_seconds) == ("smollm2", 1, 3.0)
    finally:
        reopened.dispose()


def test_events_outlive_their_deployment(db: Database) -> None:
    deployments = DeploymentStore(db)
    deployments.create(DeploymentSpec(name="smollm2", snapshot_uri="file:///snapshots/smollm2"))
    store = ScaleEventStore(db)
    store.record(_event())
    deployments.delete("smollm2")
    assert [ev.deployment for ev in store.list()] == ["smollm2"]


def test_count_by_deployment_and_since(db: Database) -> None:
    store = ScaleEventStore(db)
    for minutes, name in [(0, "a"), (5, "a"), (10, "b"), (15, "a")]:
        store.record(_event(deployment=name, created_at=T0 + timedelta(minutes=minutes)))
    assert store.count() == 4
    assert store.count("a") == 3
    assert store.count("nope") == 0
    # `since` is inclusive and compares instants, whatever the zone.
    assert store.count(since=T0 + timedelta(minutes=5)) == 3
    assert store.count("a", since=T0 + timedelta(minutes=5)) == 2
    assert store.count(since=datetime(2025, 3, 1, 8, 10, tzinfo=timezone(timedelta(hours=-4)))) == 2
    assert store.count(since=T0 + timedelta(hours=1)) == 0
    with pytest.raises(ValueError, match="timezone-aware"):
        store.count(since=datetime(2025, 3, 1, 12, 0))


def test_database_refuses_rows_that_skip_validation(db: Database) -> None:
    # The check constraints hold for writers that bypass ScaleEventRecord.
    row = {"deployment": "x", "reason": "r", "created_at": T0}
    for bad in ({"from_replicas": -1, "to_replicas": 1}, {"from_replicas": 2, "to_replicas": 2}):
        with pytest.raises(IntegrityError), db.engine.begin() as conn:
            conn.execute(insert(ScaleEvent).values(**row, **bad))
    assert ScaleEventStore(db).count() == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"deployment": ""}, "deployment must be 1 to 128"),
        ({"deployment": "x" * 129}, "deployment must be 1 to 128"),
        ({"from_replicas": -1}, "from_replicas must be an integer >= 0"),
        ({"to_replicas": True}, "to_replicas must be an integer >= 0"),
        ({"to_replicas": 2.0}, "to_replicas must be an integer >= 0"),
        ({"from_replicas": 2, "to_replicas": 2}, "must change the replica count"),
        ({"reason": ""}, "reason must be 1 to 256"),
        ({"reason": "r" * 257}, "reason must be 1 to 256"),
        ({"cold_start_seconds": -1.0}, "cold_start_seconds must be >= 0"),
        ({"cold_start_seconds": math.nan}, "cold_start_seconds must be a finite number"),
        ({"cold_start_seconds": math.inf}, "cold_start_seconds must be a finite number"),
        ({"created_at": datetime(2025, 3, 1, 12, 0)}, "created_at must be timezone-aware"),
    ],
)
def test_invalid_records_are_refused_on_construction(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _event(**overrides)


def test_boundary_values_are_accepted() -> None:
    ev = _event(
        reason="r" * 256, deployment="d" * 128, cold_start_seconds=0, to_replicas=0, from_replicas=5
    )
    assert (ev.from_replicas, ev.to_replicas, len(ev.reason)) == (5, 0, 256)
