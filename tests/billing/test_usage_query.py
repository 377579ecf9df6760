from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.prices import PriceStore
from hotpool.billing.tenants import TenantStore
from hotpool.billing.usage import (
    UsageBucketRow,
    bucket_starts,
    totals,
    usage_buckets,
)

START = datetime(2025, 3, 1, tzinfo=UTC)
END = datetime(2025, 3, 3, tzinfo=UTC)
DAY1, DAY2 = START, START + timedelta(days=1)

# (deployment, created_at, prompt, cached, completion)
EVENTS = [
    ("a", datetime(2025, 2, 28, 23, 59, 59, 999999, tzinfo=UTC), 1000, 0, 1000),  # before start
    ("a", datetime(2025, 3, 1, 0, 0, tzinfo=UTC), 1, 0, 2),  # exactly at start: counted
    ("a", datetime(2025, 3, 1, 23, 59, 59, 999999, tzinfo=UTC), 10, 2, 1),
    ("a", datetime(2025, 3, 2, 0, 0, tzinfo=UTC), 20, 0, 2),
    ("a", datetime(2025, 3, 2, 0, 0, 59, 500000, tzinfo=UTC), 30, 5, 3),
    ("a", datetime(2025, 3, 2, 0, 1, tzinfo=UTC), 40, 0, 4),
    # 13:30 UTC given in another zone: bucketed by its UTC instant.
    ("b", datetime(2025, 3, 2, 15, 30, tzinfo=timezone(timedelta(hours=2))), 100, 50, 10),
    ("a", datetime(2025, 3, 3, 0, 0, tzinfo=UTC), 2000, 0, 2000),  # exactly at end: excluded
]


@pytest.fixture
def seeded(db: Database) -> Database:
    Ledger(db).record_many(
        UsageRecord(
            request_id=f"req-{i}",
            deployment=dep,
            endpoint="chat.completions",
            status="completed",
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            created_at=at,
        )
        for i, (dep, at, prompt, cached, completion) in enumerate(EVENTS)
    )
    return db


def _row(start: datetime, width: timedelta, dep: str | None, *sums: int) -> UsageBucketRow:
    return UsageBucketRow(start, start + width, dep, *sums)


def test_daily_buckets_split_exactly_at_utc_midnight(seeded: Database) -> None:
    day = timedelta(days=1)
    assert usage_buckets(seeded, START, END) == [
        _row(DAY1, day, "a", 2, 11, 2, 3),
        _row(DAY2, day, "a", 3, 90, 5, 9),
        _row(DAY2, day, "b", 1, 100, 50, 10),
    ]


def test_hourly_buckets(seeded: Database) -> None:
    hour = timedelta(hours=1)
    assert usage_buckets(seeded, START, END, "1h") == [
        _row(DAY1, hour, "a", 1, 1, 0, 2),
        _row(DAY1 + timedelta(hours=23), hour, "a", 1, 10, 2, 1),
        _row(DAY2, hour, "a", 3, 90, 5, 9),
        _row(DAY2 + timedelta(hours=13), hour, "b", 1, 100, 50, 10),
    ]


def test_minute_buckets(seeded: Database) -> None:
    minute = timedelta(minutes=1)
    assert usage_buckets(seeded, START, END, "1m") == [
        _row(DAY1, minute, "a", 1, 1, 0, 2),
        _row(DAY1 + timedelta(hours=23, minutes=59), minute, "a", 1, 10, 2, 1),
        _row(DAY2, minute, "a", 2, 50, 5, 5),
        _row(DAY2 + minute, minute, "a", 1, 40, 0, 4),
        _row(DAY2 + timedelta(hours=13, minutes=30), minute, "b", 1, 100, 50, 10),
    ]


def test_widths_in_turn_on_one_database_each_bucket_their_own_way(seeded: Database) -> None:
    # One engine caches compiled statements; the width must not be lost in that cache.
    starts = {
        width: [r.start for r in usage_buckets(seeded, START, END, width, deployments=["b"])]
        for width in ("1d", "1h", "1m", "1d")
    }
    assert starts == {
        "1d": [DAY2],
        "1h": [DAY2 + timedelta(hours=13)],
        "1m": [DAY2 + timedelta(hours=13, minutes=30)],
    }


def test_ungrouped_buckets_sum_every_deployment(seeded: Database) -> None:
    day = timedelta(days=1)
    assert usage_buckets(seeded, START, END, group_by=()) == [
        _row(DAY1, day, None, 2, 11, 2, 3),
        _row(DAY2, day, None, 4, 190, 55, 19),
    ]


def test_deployment_filter(seeded: Database) -> None:
    day = timedelta(days=1)
    assert usage_buckets(seeded, START, END, deployments=["b"]) == [
        _row(DAY2, day, "b", 1, 100, 50, 10)
    ]
    assert usage_buckets(seeded, START, END, deployments=["b"], group_by=()) == [
        _row(DAY2, day, None, 1, 100, 50, 10)
    ]
    assert usage_buckets(seeded, START, END, deployments=["b", "a"], group_by=()) == [
        _row(DAY1, day, None, 2, 11, 2, 3),
        _row(DAY2, day, None, 4, 190, 55, 19),
    ]
    assert usage_buckets(seeded, START, END, deployments=["nope"]) == []


def test_unaligned_range_counts_only_events_inside_it(seeded: Database) -> None:
    # From 23:00 on day 1 to 00:01 on day 2, given in UTC+2: the first bucket keeps its UTC
    # boundary but counts only the 23:59:59.999999 event.
    plus2 = timezone(timedelta(hours=2))
    rows = usage_buckets(
        seeded, datetime(2025, 3, 2, 1, 0, tzinfo=plus2), datetime(2025, 3, 2, 2, 1, tzinfo=plus2)
    )
    day = timedelta(days=1)
    assert rows == [_row(DAY1, day, "a", 1, 10, 2, 1), _row(DAY2, day, "a", 2, 50, 5, 5)]


def test_bucket_sums_match_totals(seeded: Database) -> None:
    everything = usage_buckets(
        seeded, datetime(2000, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC), "1h"
    )
    assert sum(r.requests for r in everything) == len(EVENTS)
    assert sum(r.total_tokens for r in everything) == totals(seeded)["total_tokens"]
    assert totals(seeded, "b") == {
        "requests": 1,
        "prompt_tokens": 100,
        "cached_tokens": 50,
        "completion_tokens": 10,
        "total_tokens": 110,
        "cost_micros": None,  # no price was set
        "currency": None,
    }


def test_empty_ledger(db: Database) -> None:
    assert usage_buckets(db, START, END) == []
    assert totals(db)["requests"] == 0


def test_bucket_starts_cover_the_range() -> None:
    assert bucket_starts(START, END, "1d") == [DAY1, DAY2]
    assert len(bucket_starts(START, END, "1h")) == 48
    assert bucket_starts(START + timedelta(seconds=30), START + timedelta(minutes=2), "1m") == [
        START,
        START + timedelta(minutes=1),
    ]


@pytest.mark.parametrize(
    ("start", "end", "width", "message"),
    [
        (START, END, "1w", "bucket_width must be one of 1m, 1h, 1d"),
        (START.replace(tzinfo=None), END, "1d", "timezone-aware"),
        (END, START, "1d", "end must be after start"),
    ],
)
def test_bad_ranges_are_rejected(start: datetime, end: datetime, width: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bucket_starts(start, end, width)  # type: ignore[arg-type]


# --- grouping by API key, and cost ------------------------------------------------------------


@pytest.fixture
def keyed(db: Database) -> tuple[Database, str, str]:
    """Events of two keys (one of another tenant) and one without a key, with a price."""
    tenant = TenantStore(db).create("acme")
    store = KeyStore(db)
    own, _ = store.create(1, frozenset({"invoke"}))
    other, _ = store.create(tenant.id, frozenset({"invoke"}))
    PriceStore(db).set(None, 150_000, 75_000, 600_000, effective_from=START)  # $0.15/$0.60
    PriceStore(db).set("b", 1_000_000, 1_000_000, 1_000_000, effective_from=START)

    def rec(i: int, dep: str, key: int | None, tenant_id: int, prompt: int) -> UsageRecord:
        return UsageRecord(
            f"k-{i}", dep, "chat.completions", "completed", prompt, 10, api_key_id=key,
            tenant_id=tenant_id, created_at=DAY1 + timedelta(hours=i),
        )  # fmt: skip

    Ledger(db).record_many(
        [
            rec(0, "a", own.id, 1, 1000),
            rec(1, "a", own.id, 1, 3000),
            rec(2, "b", own.id, 1, 100),
            rec(3, "a", None, 1, 10),
            rec(4, "a", other.id, tenant.id, 20_000),
        ]
    )
    return db, own.prefix, other.prefix


def test_group_by_api_key_names_keys_by_prefix(keyed: tuple[Database, str, str]) -> None:
    db, own, other = keyed
    rows = usage_buckets(db, START, END, group_by=("api_key",))
    by_key = {r.api_key: (r.deployment, r.requests, r.prompt_tokens, r.cost_micros) for r in rows}
    # 1000 * 0.15 + 10 * 0.60 = 156; 3000 -> 456; "b": 110 tokens at $1 per 1M -> 110.
    assert by_key == {
        own: (None, 3, 4100, 156 + 456 + 110),
        other: (None, 1, 20_000, 3006),
        None: (None, 1, 10, 8),  # 1.5 + 6 = 7.5 micro-units: to even, 8
    }
    assert {r.currency for r in rows} == {"USD"}


def test_group_by_deployment_and_api_key(keyed: tuple[Database, str, str]) -> None:
    db, own, _ = keyed
    rows = usage_buckets(db, START, END, group_by=("deployment", "api_key"), tenant_id=1)
    assert [(r.deployment, r.api_key, r.requests, r.cost_micros) for r in rows] == [
        ("a", None, 1, 8),  # no key sorts first
        ("a", own, 2, 612),
        ("b", own, 1, 110),
    ]
    assert all(r.api_key_id is not None for r in rows if r.api_key is not None)


def test_cost_sums_by_tenant_and_in_totals(keyed: tuple[Database, str, str]) -> None:
    db, *_ = keyed
    [mine] = usage_buckets(db, START, END, group_by=(), tenant_id=1)
    assert (mine.requests, mine.cost_micros, mine.currency) == (4, 730, "USD")
    [everyone] = usage_buckets(db, START, END, group_by=())
    assert everyone.cost_micros == totals(db)["cost_micros"] == 730 + 3006


def test_unknown_group_is_rejected(db: Database) -> None:
    with pytest.raises(ValueError, match="cannot group by 'user'"):
        usage_buckets(db, START, END, group_by=("user",))
