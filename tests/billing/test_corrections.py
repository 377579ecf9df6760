"""Corrections: new rows that reference the original, so sums give the corrected usage."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import bindparam, text
from sqlalchemy.exc import IntegrityError

from hotpool.billing.db import Database
from hotpool.billing.ledger import EventNotFound, Ledger, LedgerEvent, UsageRecord
from hotpool.billing.models import UTCDateTime
from hotpool.billing.prices import PriceStore
from hotpool.billing.usage import totals, usage_buckets

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


def _rec(request_id: str = "req-1", **overrides: Any) -> UsageRecord:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "deployment": "smollm2",
        "endpoint": "chat.completions",
        "status": "partial",
        "prompt_tokens": 1000,
        "cached_tokens": 400,
        "completion_tokens": 200,
        "created_at": T0,
        "api_key_id": 7,
        "total_seconds": 1.5,
    }
    fields.update(overrides)
    return UsageRecord(**fields)


@pytest.fixture
def priced(db: Database) -> Database:
    # $1 per 1M uncached input, $0.50 cached, $2 output: a token's cost is easy to read.
    PriceStore(db).set(None, 1_000_000, 500_000, 2_000_000, effective_from=T0 - DAY)
    return db


def _sums(db: Database) -> tuple[int, int, int, int, int | None]:
    t = totals(db)
    return (t["requests"], t["prompt_tokens"], t["cached_tokens"], t["completion_tokens"],
            t["cost_micros"])  # fmt: skip


def test_a_correction_is_a_delta_row_and_sums_give_the_corrected_usage(priced: Database) -> None:
    ledger = Ledger(priced)
    ledger.record(_rec())
    assert _sums(priced) == (1, 1000, 400, 200, 600 + 200 + 400)

    fix = ledger.correct(
        "req-1", prompt_tokens=900, cached_tokens=500, completion_tokens=250, reason="recount"
    )
    assert isinstance(fix, LedgerEvent)
    [original] = [e for e in ledger.events() if e.request_id == "req-1"]
    assert fix.request_id == f"corr:{original.id}:1"
    assert (fix.corrects_id, fix.reason, fix.is_correction) == (original.id, "recount", True)
    assert (fix.prompt_tokens, fix.cached_tokens, fix.completion_tokens) == (-100, 100, 50)
    # 400 + 250 + 500 = 1150 micro-units corrected, 1200 recorded: a credit of 50.
    assert (fix.cost_micros, fix.currency) == (-50, "USD")
    # The original's tenant, key, deployment, status and time; no timings of its own.
    assert (fix.tenant_id, fix.api_key_id, fix.deployment, fix.status, fix.created_at) == (
        1, 7, "smollm2", "partial", T0
    )  # fmt: skip
    assert (fix.total_seconds, fix.cold_start) == (None, False)
    # Still one request, now with the corrected counts and cost.
    assert _sums(priced) == (1, 900, 500, 250, 1150)
    assert ledger.events()[0] == fix  # read back as returned


def test_each_correction_is_against_the_corrected_state(priced: Database) -> None:
    ledger = Ledger(priced)
    ledger.record(_rec())
    first = ledger.correct("req-1", prompt_tokens=500, completion_tokens=100, reason="a")
    second = ledger.correct("req-1", prompt_tokens=2000, completion_tokens=0, reason="b")
    assert first is not None and second is not None
    assert first.request_id.endswith(":1") and second.request_id.endswith(":2")
    assert (second.prompt_tokens, second.cached_tokens, second.completion_tokens) == (1500, 0, -100)
    assert _sums(priced) == (1, 2000, 0, 0, 2000)


def test_correcting_to_what_is_recorded_writes_nothing(priced: Database) -> None:
    ledger = Ledger(priced)
    ledger.record(_rec())
    same = {"prompt_tokens": 1000, "cached_tokens": 400, "completion_tokens": 200}
    assert ledger.correct("req-1", **same, reason="no change") is None
    assert ledger.correct("req-1", prompt_tokens=1, completion_tokens=1, reason="x") is not None
    assert ledger.correct("req-1", prompt_tokens=1, completion_tokens=1, reason="again") is None
    assert len(ledger.events()) == 2


def test_correction_of_an_unpriced_event_has_no_cost(db: Database) -> None:
    ledger = Ledger(db)
    ledger.record(_rec())
    fix = ledger.correct("req-1", prompt_tokens=10, completion_tokens=1, reason="recount")
    assert fix is not None and (fix.cost_micros, fix.currency) == (None, None)
    assert _sums(db) == (1, 10, 0, 1, None)


def test_a_correction_lands_in_the_originals_bucket(priced: Database) -> None:
    ledger = Ledger(priced)
    ledger.record(_rec("early", created_at=T0))
    ledger.record(_rec("late", created_at=T0 + DAY))
    ledger.correct("early", prompt_tokens=0, completion_tokens=0, reason="refund")
    rows = usage_buckets(priced, T0 - DAY, T0 + 2 * DAY, "1d")
    assert [(r.start.day, r.requests, r.prompt_tokens, r.cost_micros) for r in rows] == [
        (1, 1, 0, 0),
        (2, 1, 1000, 1200),
    ]


def test_bad_corrections_are_refused(priced: Database) -> None:
    ledger = Ledger(priced)
    ledger.record(_rec())
    with pytest.raises(EventNotFound, match="no usage event with request_id 'nope'"):
        ledger.correct("nope", prompt_tokens=1, completion_tokens=1, reason="x")
    with pytest.raises(ValueError, match="cached_tokens \\(5\\) exceeds prompt_tokens \\(4\\)"):
        ledger.correct("req-1", prompt_tokens=4, cached_tokens=5, completion_tokens=1, reason="x")
    with pytest.raises(ValueError, match="completion_tokens must be an integer >= 0"):
        ledger.correct("req-1", prompt_tokens=4, completion_tokens=-1, reason="x")
    with pytest.raises(ValueError, match="reason must be 1 to 1000 characters"):
        ledger.correct("req-1", prompt_tokens=4, completion_tokens=1, reason="  ")
    fix = ledger.correct("req-1", prompt_tokens=4, completion_tokens=1, reason="x")
    assert fix is not None
    with pytest.raises(ValueError, match="is a correction; correct the original"):
        ledger.correct(fix.request_id, prompt_tokens=4, completion_tokens=1, reason="x")
    assert len(ledger.events()) == 2


def test_concurrent_corrections_serialize(db: Database) -> None:
    Ledger(db).record(_rec())
    engines = [Database(db.url.render_as_string(hide_password=False)) for _ in range(8)]
    barrier = threading.Barrier(8)
    results: list[LedgerEvent | None] = [None] * 8

    def correct(i: int) -> None:
        barrier.wait()
        results[i] = Ledger(engines[i]).correct(
            "req-1", prompt_tokens=10, completion_tokens=20, reason=f"thread {i}"
        )

    threads = [threading.Thread(target=correct, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for e in engines:
            e.dispose()
    # One thread corrected; the others then found the totals already right.
    assert sum(r is not None for r in results) == 1
    assert _sums(db)[:4] == (1, 10, 0, 20)


_RAW = text(
    "INSERT INTO usage_events (request_id, tenant_id, deployment, endpoint, status,"
    " prompt_tokens, cached_tokens, completion_tokens, cold_start, created_at, cost_micros,"
    " currency, corrects_id) VALUES (:request_id, 1, 'm', 'completions', 'completed',"
    " :prompt_tokens, :cached_tokens, :completion_tokens, false, :created_at, :cost_micros,"
    " :currency, :corrects_id)"
).bindparams(bindparam("created_at", type_=UTCDateTime()))
_ROW = {
    "request_id": "raw",
    "prompt_tokens": 10,
    "cached_tokens": 3,
    "completion_tokens": 5,
    "created_at": T0,
    "cost_micros": 7,
    "currency": "USD",
    "corrects_id": None,
}


@pytest.mark.parametrize(
    "values",
    [{"prompt_tokens": -1, "cached_tokens": -1}, {"cached_tokens": -1}, {"completion_tokens": -1},
     {"cached_tokens": 11}, {"cost_micros": -1}],
    ids=["prompt<0", "cached<0", "completion<0", "cached>prompt", "cost<0"],
)  # fmt: skip
def test_negative_counts_and_costs_only_on_correction_rows(
    db: Database, values: dict[str, Any]
) -> None:
    with db.engine.begin() as conn:
        conn.execute(_RAW, {**_ROW, **values, "request_id": "corr", "corrects_id": 1})
    with pytest.raises(IntegrityError), db.engine.begin() as conn:
        conn.execute(_RAW, {**_ROW, **values})


@pytest.mark.parametrize(
    "values", [{"cost_micros": None}, {"currency": None}], ids=["no cost", "no currency"]
)
def test_a_cost_always_has_its_currency(db: Database, values: dict[str, Any]) -> None:
    with db.engine.begin() as conn:
        conn.execute(
            _RAW, {**_ROW, "request_id": "both-null", "cost_micros": None, "currency": None}
        )
    with pytest.raises(IntegrityError), db.engine.begin() as conn:
        conn.execute(_RAW, {**_ROW, **values})
