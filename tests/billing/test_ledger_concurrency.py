"""Racing writers on SQLite and PostgreSQL: every event lands exactly once.

Each thread has its own engine (its own connections, as separate control planes or a replay
beside the live writer would), and the threads are released together by a barrier.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TypeVar

import pytest
from sqlalchemy import func, select

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import UsageEvent

T = TypeVar("T")
THREADS = 8
T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _rec(request_id: str, completion_tokens: int = 7) -> UsageRecord:
    return UsageRecord(
        request_id=request_id,
        deployment="smollm2",
        endpoint="chat.completions",
        status="completed",
        prompt_tokens=12,
        completion_tokens=completion_tokens,
        created_at=T0,
    )


@pytest.fixture
def ledgers(db: Database) -> Iterator[list[Ledger]]:
    """One ledger per thread, each on its own engine."""
    engines = [Database(db.url.render_as_string(hide_password=False)) for _ in range(THREADS)]
    yield [Ledger(e) for e in engines]
    for e in engines:
        e.dispose()


def _race(fn: Callable[[int], T]) -> list[T]:
    """fn(0..THREADS-1) in threads released together, so their writes really collide."""
    barrier = threading.Barrier(THREADS)

    def run(i: int) -> T:
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(run, range(THREADS)))


def _rows(db: Database) -> dict[str, int]:
    """request_id -> completion tokens of every row."""
    with db.engine.connect() as conn:
        stmt = select(UsageEvent.request_id, UsageEvent.completion_tokens)
        return {r: c for r, c in conn.execute(stmt)}


def _count(db: Database) -> int:
    with db.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(UsageEvent)).scalar_one()


def test_eight_threads_inserting_the_same_event_leave_one_row(
    db: Database, ledgers: list[Ledger]
) -> None:
    for round_ in range(5):  # several rounds: a lost race shows up as two rows
        request_id = f"same-{round_}"
        won = _race(lambda i, r=request_id: ledgers[i].record(_rec(r, completion_tokens=i)))
        assert won.count(True) == 1 and won.count(False) == THREADS - 1
        # The row is the winner's, whole: not a mix of two writers' values.
        assert _rows(db)[request_id] == won.index(True)
    assert _count(db) == 5


def test_the_same_batch_sent_by_eight_threads_lands_once(
    db: Database, ledgers: list[Ledger]
) -> None:
    batch = [_rec(f"shared-{n}") for n in range(200)]
    inserted = _race(lambda i: ledgers[i].record_many(batch))
    assert sum(inserted) == 200
    assert _count(db) == 200


def test_many_distinct_events_from_eight_threads_all_land_once(
    db: Database, ledgers: list[Ledger]
) -> None:
    per_thread, batch = 1000, 50

    def write(i: int) -> int:
        ids = [f"t{i}-{n}" for n in range(per_thread)]
        # Every thread also re-sends the first 100 of its neighbour's: replays interleave.
        ids += [f"t{(i + 1) % THREADS}-{n}" for n in range(100)]
        return sum(
            ledgers[i].record_many(_rec(r) for r in ids[k : k + batch])
            for k in range(0, len(ids), batch)
        )

    assert sum(_race(write)) == THREADS * per_thread
    rows = _rows(db)
    assert len(rows) == THREADS * per_thread
    assert set(rows) == {f"t{i}-{n}" for i in range(THREADS) for n in range(per_thread)}
