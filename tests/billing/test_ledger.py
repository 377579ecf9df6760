from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, TypeVar

import pytest
from sqlalchemy import bindparam, func, select, text
from sqlalchemy.exc import IntegrityError

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import UsageEvent, UTCDateTime

T = TypeVar("T")
T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _rec(request_id: str = "req-1", **overrides: Any) -> UsageRecord:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "deployment": "smollm2",
        "endpoint": "chat.completions",
        "status": "completed",
        "prompt_tokens": 12,
        "completion_tokens": 7,
        "created_at": T0,
    }
    fields.update(overrides)
    return UsageRecord(**fields)


def _count(db: Database) -> int:
    with db.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(UsageEvent)).scalar_one()


def _in_threads(n: int, fn: Callable[[int], T]) -> list[T]:
    """Run fn(0..n-1) in n threads released together, so their writes really race."""
    barrier = threading.Barrier(n)

    def run(i: int) -> T:
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def test_record_round_trips_every_field(db: Database) -> None:
    ledger = Ledger(db)
    rec = _rec(
        cached_tokens=4,
        tenant_id=1,
        queue_seconds=0.25,
        ttft_seconds=1.5,
        total_seconds=3.0,
        cold_start=True,
        status="partial",
        error="stream cut by client",
        client_request_id="client-7f3a/retry 2",
        created_at=datetime(2025, 3, 1, 14, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2))),
    )
    assert ledger.record(rec) is True
    [back] = ledger.events()
    expected = replace(rec, created_at=datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC))
    assert back.record == expected
    assert (back.cost_micros, back.currency, back.corrects_id, back.reason) == (None,) * 4
    assert back.created_at is not None and back.created_at.tzinfo is UTC
    assert back.total_tokens == 19


def test_client_request_id_is_kept_beside_the_ledger_key(db: Database) -> None:
    ledger = Ledger(db)
    # Two requests may carry the same client id: only the server's request_id is unique.
    assert ledger.record(_rec("req-1", client_request_id="c" * 64)) is True
    assert ledger.record(_rec("req-2", client_request_id="c" * 64)) is True
    assert ledger.record(_rec("req-3")) is True
    by_id = {r.request_id: r.client_request_id for r in ledger.events()}
    assert by_id == {"req-1": "c" * 64, "req-2": "c" * 64, "req-3": None}


def test_created_at_defaults_to_now(db: Database) -> None:
    ledger = Ledger(db)
    before = datetime.now(UTC)
    ledger.record(_rec(created_at=None))
    after = datetime.now(UTC)
    [back] = ledger.events()
    assert back.created_at is not None
    assert before <= back.created_at <= after


def test_replayed_request_id_records_once(db: Database) -> None:
    ledger = Ledger(db)
    assert ledger.record(_rec("req-1")) is True
    # A replay with different numbers is still a replay: the first record stands.
    assert ledger.record(_rec("req-1", prompt_tokens=999)) is False
    assert _count(db) == 1
    assert ledger.events()[0].prompt_tokens == 12


def test_concurrent_replays_record_once(db: Database) -> None:
    ledger = Ledger(db)
    results = _in_threads(8, lambda i: ledger.record(_rec("req-race", completion_tokens=i)))
    assert sorted(results) == [False] * 7 + [True]
    assert _count(db) == 1


def test_concurrent_batches_with_overlapping_ids_record_each_once(db: Database) -> None:
    ledger = Ledger(db)

    def write(i: int) -> int:
        # Thread i writes ids i*10 .. i*10+19: each id but the first ten and last ten twice.
        return ledger.record_many(_rec(f"req-{n}") for n in range(i * 10, i * 10 + 20))

    assert sum(_in_threads(8, write)) == 90
    assert _count(db) == 90


def test_record_many_counts_only_new_records(db: Database) -> None:
    ledger = Ledger(db)
    assert ledger.record_many([_rec("a"), _rec("b")]) == 2
    assert ledger.record_many([_rec("b"), _rec("c"), _rec("c")]) == 1
    assert ledger.record_many([]) == 0
    assert _count(db) == 3


def test_record_many_handles_batches_larger_than_one_insert(db: Database) -> None:
    ledger = Ledger(db)
    assert ledger.record_many(_rec(f"req-{n}") for n in range(1234)) == 1234
    assert _count(db) == 1234


def test_events_are_newest_first_and_filter_by_deployment(db: Database) -> None:
    ledger = Ledger(db)
    for n in range(5):
        deployment = "a" if n % 2 == 0 else "b"
        ledger.record(_rec(f"req-{n}", deployment=deployment, created_at=T0 + timedelta(n)))
    assert [r.request_id for r in ledger.events()] == [f"req-{n}" for n in (4, 3, 2, 1, 0)]
    assert [r.request_id for r in ledger.events("a")] == ["req-4", "req-2", "req-0"]
    assert [r.request_id for r in ledger.events("a", limit=2)] == ["req-4", "req-2"]
    assert ledger.events("nope") == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prompt_tokens": -1}, "prompt_tokens must be an integer >= 0"),
        ({"completion_tokens": -5}, "completion_tokens must be an integer >= 0"),
        ({"cached_tokens": -1}, "cached_tokens must be an integer >= 0"),
        ({"prompt_tokens": 1.5}, "prompt_tokens must be an integer"),
        ({"completion_tokens": True}, "completion_tokens must be an integer"),
        ({"cached_tokens": 13}, r"cached_tokens \(13\) exceeds prompt_tokens \(12\)"),
        ({"status": "done"}, "status 'done' is not one of completed, partial, error, cancelled"),
        ({"request_id": ""}, "request_id must be 1 to 64 characters"),
        ({"request_id": "x" * 65}, "request_id must be 1 to 64 characters"),
        ({"deployment": ""}, "deployment must not be empty"),
        ({"endpoint": ""}, "endpoint must not be empty"),
        ({"ttft_seconds": -0.1}, "ttft_seconds must be >= 0"),
        ({"total_seconds": float("nan")}, "total_seconds must be >= 0"),
        ({"created_at": datetime(2025, 1, 1)}, "created_at must be timezone-aware"),
        ({"client_request_id": "x" * 65}, "client_request_id must be 1 to 64 printable ASCII"),
        ({"client_request_id": ""}, "client_request_id must be 1 to 64 printable ASCII"),
        ({"client_request_id": "a\nb"}, "client_request_id must be 1 to 64 printable ASCII"),
        ({"client_request_id": "caf\u00e9"}, "client_request_id must be 1 to 64 printable"),
        ({"client_request_id": 42}, "client_request_id must be 1 to 64 printable ASCII"),
    ],
)
def test_invalid_records_are_rejected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _rec(**overrides)


_RAW_INSERT = text(
    "INSERT INTO usage_events (request_id, tenant_id, deployment, endpoint, status,"
    " prompt_tokens, cached_tokens, completion_tokens, cold_start, created_at)"
    " VALUES (:request_id, :tenant_id, 'm', 'completions', :status,"
    " :prompt_tokens, :cached_tokens, :completion_tokens, :cold_start, :created_at)"
).bindparams(bindparam("created_at", type_=UTCDateTime()))
_VALID_ROW = {
    "request_id": "raw-1",
    "tenant_id": 1,
    "status": "completed",
    "prompt_tokens": 10,
    "cached_tokens": 3,
    "completion_tokens": 5,
    "cold_start": False,
    "created_at": T0,
}


@pytest.mark.parametrize(
    "bad",
    [
        {"prompt_tokens": -1, "cached_tokens": 0},
        {"cached_tokens": -1},
        {"completion_tokens": -1},
        {"cached_tokens": 11},
        {"status": "bogus"},
        {"tenant_id": 999},  # foreign key, enforced on SQLite too
    ],
    ids=["prompt<0", "cached<0", "completion<0", "cached>prompt", "status", "tenant"],
)
def test_database_constraints_reject_what_python_would(db: Database, bad: dict[str, Any]) -> None:
    with db.engine.begin() as conn:
        conn.execute(_RAW_INSERT, _VALID_ROW)  # the same statement is fine with valid values
    with pytest.raises(IntegrityError), db.engine.begin() as conn:
        conn.execute(_RAW_INSERT, {**_VALID_ROW, "request_id": "raw-2", **bad})
    assert _count(db) == 1


def test_database_rejects_duplicate_request_id_without_on_conflict(db: Database) -> None:
    with db.engine.begin() as conn:
        conn.execute(_RAW_INSERT, _VALID_ROW)
    with pytest.raises(IntegrityError), db.engine.begin() as conn:
        conn.execute(_RAW_INSERT, _VALID_ROW)
