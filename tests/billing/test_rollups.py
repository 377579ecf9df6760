from __future__ import annotations

from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, text

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import UsageRollupHourly
from hotpool.billing.prices import PriceStore
from hotpool.billing.rollups import Mismatch, check, floor_hour, rebuild, rebuild_all
from hotpool.billing.tenants import TenantStore
from hotpool.billing.usage import totals

H0 = datetime(2025, 3, 1, 10, tzinfo=UTC)
HOUR = timedelta(hours=1)


def _record(
    db: Database,
    request_id: str,
    at: datetime,
    prompt: int = 10,
    completion: int = 5,
    *,
    cached: int = 0,
    deployment: str = "a",
    tenant_id: int = 1,
) -> None:
    rec = UsageRecord(
        request_id,
        deployment,
        "chat.completions",
        "completed",
        prompt,
        completion,
        cached_tokens=cached,
        tenant_id=tenant_id,
        created_at=at,
    )
    assert Ledger(db).record(rec)


def _rollups(db: Database) -> list[tuple[object, ...]]:
    r = UsageRollupHourly
    stmt = select(
        r.hour,
        r.tenant_id,
        r.deployment,
        r.requests,
        r.prompt_tokens,
        r.cached_tokens,
        r.completion_tokens,
        r.cost_micros,
        r.currency,
    ).order_by(r.hour, r.tenant_id, r.deployment)
    with db.engine.connect() as conn:
        return [tuple(row) for row in conn.execute(stmt)]


def test_rebuild_sums_each_hour_tenant_and_deployment(db: Database) -> None:
    acme = TenantStore(db).create("acme").id
    _record(db, "r1", H0, 10, 5, cached=4)
    _record(db, "r2", H0 + timedelta(minutes=30), 20, 7)
    _record(db, "r3", H0 + timedelta(minutes=31), 1, 1, deployment="b")
    _record(db, "r4", H0 + timedelta(minutes=32), 2, 2, tenant_id=acme)
    _record(db, "r5", H0 + 2 * HOUR, 3, 3)

    assert rebuild_all(db) == 4
    assert _rollups(db) == [
        (H0, 1, "a", 2, 30, 4, 12, None, None),
        (H0, 1, "b", 1, 1, 0, 1, None, None),
        (H0, acme, "a", 1, 2, 0, 2, None, None),
        (H0 + 2 * HOUR, 1, "a", 1, 3, 0, 3, None, None),
    ]
    assert check(db) == []


def test_events_exactly_at_hour_boundaries_land_in_their_own_hour(db: Database) -> None:
    _record(db, "before", H0 + HOUR - timedelta(microseconds=1000), 1, 1)  # hh:59:59.999
    _record(db, "last", H0 + HOUR - timedelta(microseconds=1), 2, 2)  # hh:59:59.999999
    _record(db, "at", H0 + HOUR, 4, 4)  # hh+1:00:00
    rebuild_all(db)
    assert [row[:5] for row in _rollups(db)] == [(H0, 1, "a", 2, 3), (H0 + HOUR, 1, "a", 1, 4)]
    # A range ending exactly at the hour rebuilds only the hour before it.
    with db.engine.begin() as conn:
        conn.execute(text("DELETE FROM usage_rollups_hourly"))
    assert rebuild(db, H0, H0 + HOUR) == 1
    assert [row[0] for row in _rollups(db)] == [H0]


def test_times_in_another_zone_are_rolled_up_by_their_utc_hour(db: Database) -> None:
    plus2 = timezone(timedelta(hours=2))
    _record(db, "r1", datetime(2025, 3, 1, 12, 30, tzinfo=plus2))
    rebuild(
        db, datetime(2025, 3, 1, 12, 0, tzinfo=plus2), datetime(2025, 3, 1, 13, 0, tzinfo=plus2)
    )
    assert [row[0] for row in _rollups(db)] == [H0]
    assert _rollups(db)[0][0].tzinfo is UTC  # type: ignore[union-attr]


def test_corrections_and_costs_are_summed_but_corrections_are_not_requests(db: Database) -> None:
    PriceStore(db).set(None, 1_000_000, 500_000, 2_000_000, effective_from=H0)
    _record(db, "unpriced", H0 - timedelta(minutes=1), 100, 100)
    _record(db, "r1", H0 + timedelta(minutes=1), 10, 5)  # 10 + 10 = 20 micros
    _record(db, "r2", H0 + timedelta(minutes=2), 4, 1, cached=2)  # 2 + 1 + 2 = 5 micros
    Ledger(db).correct("r1", prompt_tokens=7, completion_tokens=5, reason="recount")  # -3 micros

    rebuild_all(db)
    assert _rollups(db) == [
        (H0 - HOUR, 1, "a", 1, 100, 0, 100, None, None),
        (H0, 1, "a", 2, 11, 2, 6, 22, "USD"),
    ]
    assert check(db) == []


def test_events_after_a_rebuild_are_reported_until_the_next_rebuild(db: Database) -> None:
    _record(db, "r1", H0)
    assert rebuild_all(db) == 1
    assert check(db) == []

    _record(db, "r2", H0 + timedelta(minutes=5), 1, 2)  # a rolled-up hour changes
    _record(db, "r3", H0 + 3 * HOUR, 7, 8, deployment="b")  # an hour with no rollup yet
    assert check(db) == [
        Mismatch(H0, 1, "a", "requests", 1, 2),
        Mismatch(H0, 1, "a", "prompt_tokens", 10, 11),
        Mismatch(H0, 1, "a", "completion_tokens", 5, 7),
        Mismatch(H0 + 3 * HOUR, 1, "b", "row", None, 1),
    ]
    assert str(check(db)[0]) == (
        "2025-03-01 10:00 UTC tenant 1 a: requests is 1 in the rollup, 2 in events"
    )
    # check can look at a range only.
    assert [m.field for m in check(db, H0 + HOUR, H0 + 4 * HOUR)] == ["row"]

    assert rebuild_all(db) == 2
    assert check(db) == []


def test_a_rollup_without_events_is_reported(db: Database) -> None:
    _record(db, "r1", H0)
    rebuild_all(db)
    with db.engine.begin() as conn:
        conn.execute(text("UPDATE usage_rollups_hourly SET deployment = 'ghost'"))
    assert check(db) == [
        Mismatch(H0, 1, "a", "row", None, 1),
        Mismatch(H0, 1, "ghost", "row", 1, None),
    ]
    assert (
        str(check(db)[1])
        == "2025-03-01 10:00 UTC tenant 1 ghost: rollup of 1 requests has no events"
    )


def test_rebuild_of_a_sub_range_leaves_other_hours_untouched(db: Database) -> None:
    for h in range(4):
        _record(db, f"r{h}", H0 + h * HOUR, 10 + h, 1)
    rebuild_all(db)
    with db.engine.begin() as conn:
        # Tamper with every rollup, so a rebuilt hour shows.
        conn.execute(text("UPDATE usage_rollups_hourly SET prompt_tokens = 0"))
    # Any time inside an hour rebuilds the whole hour: [10:30, 12:00) is 10:00 and 11:00.
    assert rebuild(db, H0 + HOUR / 2, H0 + 2 * HOUR) == 2
    assert [row[4] for row in _rollups(db)] == [10, 11, 0, 0]
    assert [m.hour for m in check(db)] == [H0 + 2 * HOUR, H0 + 3 * HOUR]


def test_rebuild_is_idempotent(db: Database) -> None:
    _record(db, "r1", H0)
    _record(db, "r2", H0 + HOUR, deployment="b")
    assert rebuild_all(db) == 2
    first = _rollups(db)
    assert rebuild_all(db) == 2
    assert rebuild(db, H0, H0 + 2 * HOUR) == 2
    assert _rollups(db) == first
    assert check(db) == []


def test_rebuild_refuses_bad_ranges(db: Database) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        rebuild(db, datetime(2025, 3, 1), None)
    with pytest.raises(ValueError, match="after start"):
        rebuild(db, H0, H0)


def test_rebuild_of_no_events_writes_nothing(db: Database) -> None:
    assert rebuild_all(db) == 0
    assert check(db) == []


EVENTS = st.lists(
    st.tuples(
        st.integers(0, 4 * 3600 * 1000),  # milliseconds after H0
        st.sampled_from(["a", "b"]),
        st.sampled_from([1, 2]),
        st.integers(0, 10_000),  # prompt
        st.integers(0, 10_000),  # completion
        st.booleans(),  # corrected afterwards
    ),
    max_size=25,
)


@settings(
    max_examples=20,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(events=EVENTS)
def test_rollups_equal_the_events_they_sum(
    db: Database, events: list[tuple[int, str, int, int, int, bool]]
) -> None:
    with db.engine.begin() as conn:  # each example starts from an empty ledger
        conn.execute(text("DELETE FROM usage_rollups_hourly"))
        conn.execute(text("DELETE FROM usage_events"))
        conn.execute(text("DELETE FROM prices"))
    if TenantStore(db).get(2) is None:
        assert TenantStore(db).create("second").id == 2
    # Events of the first two hours have no price in force, the later ones have.
    PriceStore(db).set(None, 1_500_000, 0, 3_000_000, effective_from=H0 + 2 * HOUR)
    ledger = Ledger(db)
    for i, (ms, dep, tenant, prompt, completion, corrected) in enumerate(events):
        _record(
            db,
            f"p{i}",
            H0 + timedelta(milliseconds=ms),
            prompt,
            completion,
            deployment=dep,
            tenant_id=tenant,
        )
        if corrected:
            ledger.correct(
                f"p{i}", prompt_tokens=prompt // 2, completion_tokens=completion, reason="r"
            )

    expected: dict[tuple[object, ...], Counter[str]] = defaultdict(Counter)
    costs: dict[tuple[object, ...], int] = {}
    for e in ledger.events(limit=1000):
        key = (floor_hour(e.created_at), e.tenant_id, e.deployment)
        expected[key].update(
            requests=0 if e.is_correction else 1,
            prompt=e.prompt_tokens,
            completion=e.completion_tokens,
        )
        if e.cost_micros is not None:
            costs[key] = costs.get(key, 0) + e.cost_micros

    assert rebuild_all(db) == len(expected)
    assert check(db) == []
    got = {row[:3]: row for row in _rollups(db)}
    assert got.keys() == expected.keys()
    for key, sums in expected.items():
        _, _, _, requests, prompt, _, completion, cost, currency = got[key]
        assert (requests, prompt, completion) == (
            sums["requests"],
            sums["prompt"],
            sums["completion"],
        )
        assert (cost, currency) == ((costs[key], "USD") if key in costs else (None, None))
    all_events = totals(db)
    assert sum(r[4] for r in got.values()) == all_events["prompt_tokens"]
    assert sum(r[3] for r in got.values()) == all_events["requests"]
