"""Money in the ledger: each event priced at ingest, sums exact, no drift over a million."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

import pytest
from sqlalchemy import event, func, select

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import UsageEvent
from hotpool.billing.prices import PriceBook, PriceRecord, PriceStore, format_micros
from hotpool.billing.usage import totals, usage_buckets

T0 = datetime(2025, 3, 1, tzinfo=UTC)
DAY = timedelta(days=1)


def _rec(request_id: str, **overrides: Any) -> UsageRecord:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "deployment": "smollm2",
        "endpoint": "chat.completions",
        "status": "completed",
        "prompt_tokens": 1000,
        "cached_tokens": 400,
        "completion_tokens": 200,
        "created_at": T0 + DAY,
    }
    fields.update(overrides)
    return UsageRecord(**fields)


def _exact_cost(p: PriceRecord, prompt: int, cached: int, completion: int) -> int:
    """The reference: the exact rational cost, rounded half to even by Python's round()."""
    micros = (prompt - cached) * p.input + cached * p.cached_input + completion * p.output
    return round(Fraction(micros, 1_000_000))


def _costs(db: Database) -> dict[str, tuple[int | None, str | None]]:
    return {e.request_id: (e.cost_micros, e.currency) for e in Ledger(db).events(limit=10_000)}


def test_each_event_is_billed_at_the_price_in_force_at_its_time(db: Database) -> None:
    store = PriceStore(db)
    # $0.150001 / $0.075001 / $0.600001 per 1M tokens, then a change mid-period.
    first = store.set(None, 150_001, 75_001, 600_001, effective_from=T0)
    second = store.set(None, 123_457, 61_729, 987_653, effective_from=T0 + 2 * DAY)
    change = T0 + 2 * DAY
    ledger = Ledger(db)
    ledger.record_many(
        [
            _rec("before", created_at=change - timedelta(microseconds=1)),
            _rec("at", created_at=change),
            _rec("after", created_at=change + DAY),
        ]
    )
    assert _costs(db) == {
        "before": (_exact_cost(first, 1000, 400, 200), "USD"),
        "at": (_exact_cost(second, 1000, 400, 200), "USD"),
        "after": (_exact_cost(second, 1000, 400, 200), "USD"),
    }
    # 600 * 0.150001 + 400 * 0.075001 + 200 * 0.600001 = 240.0007 micro-units -> 240
    assert _costs(db)["before"] == (240, "USD")


def test_a_deployments_own_price_beats_the_default(db: Database) -> None:
    store = PriceStore(db)
    store.set(None, 1_000_000, 1_000_000, 1_000_000, effective_from=T0)  # $1 per 1M
    store.set("cheap", 100_000, 100_000, 100_000, effective_from=T0 + DAY)  # $0.10 per 1M
    Ledger(db).record_many(
        [
            _rec("cheap-early", deployment="cheap", created_at=T0 + DAY / 2),  # before its own
            _rec("cheap-later", deployment="cheap", created_at=T0 + 2 * DAY),
            _rec("other", deployment="other", created_at=T0 + 2 * DAY),
        ]
    )
    assert _costs(db) == {
        "cheap-early": (1200, "USD"),
        "cheap-later": (120, "USD"),
        "other": (1200, "USD"),
    }


def test_without_a_price_the_cost_is_null_not_zero(db: Database) -> None:
    PriceStore(db).set(None, 1_000_000, 1_000_000, 1_000_000, effective_from=T0 + DAY)
    ledger = Ledger(db)
    ledger.record(_rec("unpriced", created_at=T0))  # before the first price
    assert _costs(db) == {"unpriced": (None, None)}
    assert totals(db)["cost_micros"] is None
    ledger.record(_rec("priced", created_at=T0 + DAY))
    assert totals(db)["cost_micros"] == 1200  # a sum over the priced events only
    assert totals(db)["currency"] == "USD"


def test_a_replay_records_once_and_keeps_the_first_cost(db: Database) -> None:
    store = PriceStore(db)
    store.set(None, 1_000_000, 1_000_000, 1_000_000, effective_from=T0)
    ledger = Ledger(db)
    assert ledger.record(_rec("req-1")) is True
    # A price that would have applied, set afterwards, does not reprice the event...
    store.set("smollm2", 2_000_000, 2_000_000, 2_000_000, effective_from=T0)
    # ...and a replay, priced anew, is still a no-op.
    assert ledger.record(_rec("req-1")) is False
    assert ledger.record_many([_rec("req-1"), _rec("req-1"), _rec("req-2")]) == 1
    assert _costs(db) == {"req-1": (1200, "USD"), "req-2": (2400, "USD")}


def test_prices_are_read_once_per_batch(db: Database) -> None:
    store = PriceStore(db)
    store.set(None, 1, 1, 1, effective_from=T0)
    for name in ("a", "b", "c"):
        store.set(name, 2, 2, 2, effective_from=T0)
    statements: list[str] = []

    def on_execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(db.engine, "before_cursor_execute", on_execute)
    try:
        recs = [_rec(f"r{i}", deployment="abcd"[i % 4]) for i in range(2000)]
        assert Ledger(db).record_many(recs) == 2000
    finally:
        event.remove(db.engine, "before_cursor_execute", on_execute)
    assert sum("FROM prices" in s for s in statements) == 1


def test_recorded_costs_are_exact_and_sum_exactly(db: Database) -> None:
    store = PriceStore(db)
    prices = [
        store.set(None, 150_001, 75_001, 600_001, effective_from=T0),
        store.set(None, 123_457, 61_729, 987_653, effective_from=T0 + 5 * DAY),
        store.set("b", 3, 1, 7, effective_from=T0),
    ]
    book = PriceBook(prices)
    recs = [
        _rec(
            f"r{i}",
            deployment="ab"[i % 2],
            prompt_tokens=(p := 1 + i * 7919 % 4000),
            cached_tokens=i * 31 % (p + 1),
            completion_tokens=i * 104_729 % 1500,
            created_at=T0 + i * timedelta(seconds=43),  # 20,000 events over 10 days
        )
        for i in range(20_000)
    ]
    assert Ledger(db).record_many(recs) == len(recs)

    expected = {}
    for r in recs:
        price = book.in_force(r.deployment, r.created_at)  # type: ignore[arg-type]
        assert price is not None
        expected[r.request_id] = _exact_cost(
            price, r.prompt_tokens, r.cached_tokens, r.completion_tokens
        )
    with db.engine.connect() as conn:
        stored = dict(conn.execute(select(UsageEvent.request_id, UsageEvent.cost_micros)).all())
    assert stored == expected
    total = sum(expected.values())
    assert totals(db)["cost_micros"] == total
    rows = usage_buckets(db, T0, T0 + 11 * DAY, "1d", group_by=("deployment",))
    assert sum(r.cost_micros or 0 for r in rows) == total
    assert {r.currency for r in rows} == {"USD"}


# --- a million events --------------------------------------------------------------------------

MILLION = 1_000_000
_COLUMNS = (
    "request_id", "tenant_id", "deployment", "endpoint", "status", "prompt_tokens",
    "cached_tokens", "completion_tokens", "cold_start", "created_at", "cost_micros", "currency",
)  # fmt: skip


def _bulk_insert(db: Database, rows: Iterator[tuple[Any, ...]]) -> None:
    """The fastest way in for each database. A test-only path: the ledger's own INSERT is
    covered above; what is under test here is storing and summing a million costs."""
    raw = db.engine.raw_connection()
    try:
        cursor = raw.cursor()
        if db.is_sqlite:  # created_at as SQLAlchemy stores it there: naive UTC text
            marks = ", ".join("?" * len(_COLUMNS))
            cursor.executemany(
                f"INSERT INTO usage_events ({', '.join(_COLUMNS)}) VALUES ({marks})",
                ((*r[:9], r[9].strftime("%Y-%m-%d %H:%M:%S.%f"), *r[10:]) for r in rows),
            )
        else:
            buffer = io.StringIO()
            csv.writer(buffer).writerows((*r[:9], r[9].isoformat(), *r[10:]) for r in rows)
            buffer.seek(0)
            cursor.copy_expert(
                f"COPY usage_events ({', '.join(_COLUMNS)}) FROM STDIN WITH (FORMAT csv)", buffer
            )
        raw.commit()
    finally:
        raw.close()


@pytest.mark.slow
def test_a_million_events_sum_without_drift(db: Database) -> None:
    store = PriceStore(db)
    # Six decimal places, a price change mid-period, and a deployment with its own price.
    book = PriceBook(
        [
            store.set(None, 150_001, 75_001, 600_001, effective_from=T0),
            store.set(None, 123_457, 61_729, 987_653, effective_from=T0 + 5 * DAY),
            store.set("b", 333_333, 166_667, 999_999, effective_from=T0 + 3 * DAY),
        ]
    )
    billed = 0  # the sum of the events' costs, in Python's unbounded integers
    unrounded = 0  # the sum of their exact costs, in millionths of a micro-unit

    def events() -> Iterator[tuple[Any, ...]]:
        nonlocal billed, unrounded
        step = timedelta(microseconds=864_000)  # a million events over ten days
        for i in range(MILLION):
            prompt = 1 + i * 7919 % 4000
            cached = i * 31 % (prompt + 1)
            completion = i * 104_729 % 1500
            deployment, at = "ab"[i % 2], T0 + i * step
            price = book.in_force(deployment, at)  # the ledger's own lookup and cost
            assert price is not None
            cost = price.cost_micros(prompt, cached, completion)
            billed += cost
            unrounded += (
                (prompt - cached) * price.input
                + cached * price.cached_input
                + completion * price.output
            )
            yield (f"m{i}", 1, deployment, "completions", "completed", prompt, cached,
                   completion, False, at, cost, price.currency)  # fmt: skip

    _bulk_insert(db, events())

    # Storing and summing: the database's sum is the exact integer, in every query.
    with db.engine.connect() as conn:
        count, sql_sum = conn.execute(select(func.count(), func.sum(UsageEvent.cost_micros))).one()
    assert (count, int(sql_sum)) == (MILLION, billed)
    assert totals(db)["cost_micros"] == billed
    days = usage_buckets(db, T0, T0 + 10 * DAY, "1d", group_by=("deployment",))
    assert sum(r.requests for r in days) == MILLION
    assert sum(r.cost_micros or 0 for r in days) == billed
    assert Fraction(format_micros(billed)) == Fraction(billed, 1_000_000)  # shown exactly
    # Rounding: each event is off by at most half a micro-unit, and halves to even lean
    # neither way; these prices' odd last digits still tilt the leftovers a little, so the
    # million stay within a hundredth of a unit of the unrounded total ($0.01 of about $940),
    # where rounding down would lose about $0.50.
    drift = Fraction(unrounded, 1_000_000) - billed
    assert abs(drift) < MILLION // 100, float(drift)
