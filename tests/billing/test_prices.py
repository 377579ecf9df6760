"""Prices: which one is in force, what a request costs, and how amounts are written."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta, timezone
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from hotpool.billing.db import Database
from hotpool.billing.prices import (
    MAX_PRICE_MICROS,
    CurrencyMismatch,
    PriceBook,
    PriceExists,
    PriceRecord,
    PriceStore,
    cost_micros,
    divide_half_even,
    format_micros,
    parse_amount,
)

T0 = datetime(2025, 3, 1, tzinfo=UTC)
DAY = timedelta(days=1)


def _price(deployment: str | None = None, at: datetime = T0, **amounts: int) -> PriceRecord:
    values = {"input": 150_000, "cached_input": 75_000, "output": 600_000, **amounts}
    return PriceRecord(deployment, effective_from=at, **values)


# --- cost of one request ----------------------------------------------------------------------


def test_cost_prices_uncached_cached_and_output_tokens_each_at_their_own_rate() -> None:
    # $0.15 / $0.075 / $0.60 per 1M: 1M uncached + 1M cached + 1M output tokens = $0.825.
    price = _price()
    assert price.cost_micros(2_000_000, 1_000_000, 1_000_000) == 825_000
    assert cost_micros(price, 2_000_000, 1_000_000, 1_000_000) == 825_000
    assert price.cost_micros(0, 0, 0) == 0


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (3, 0),  # 0.45 micro-units: down
        (4, 1),  # 0.6: up
        (10, 2),  # 1.5 exactly: to even (2)
        (30, 4),  # 4.5 exactly: to even (4)
        (50, 8),  # 7.5 exactly: to even (8)
    ],
)
def test_cost_rounds_to_the_nearest_micro_unit_and_halves_to_even(
    prompt: int, expected: int
) -> None:
    price = _price(input=150_000)  # 0.15 micro-units per token
    assert price.cost_micros(prompt, 0, 0) == expected


@given(
    prompt=st.integers(0, 2**31 - 1),
    cached_share=st.fractions(0, 1),
    completion=st.integers(0, 2**31 - 1),
    input_=st.integers(0, MAX_PRICE_MICROS),
    cached_input=st.integers(0, MAX_PRICE_MICROS),
    output=st.integers(0, MAX_PRICE_MICROS),
)
def test_cost_is_the_exact_rational_cost_rounded_half_even(
    prompt: int,
    cached_share: Fraction,
    completion: int,
    input_: int,
    cached_input: int,
    output: int,
) -> None:
    cached = int(prompt * cached_share)
    price = _price(input=input_, cached_input=cached_input, output=output)
    exact = Fraction((prompt - cached) * input_ + cached * cached_input + completion * output)
    exact /= 1_000_000
    # Python rounds a Fraction half to even: an independent reference for the rule.
    assert price.cost_micros(prompt, cached, completion) == round(exact)
    assert price.cost_micros(prompt, cached, completion) < 2**63  # fits a BIGINT


def test_divide_half_even() -> None:
    assert [divide_half_even(n, 10) for n in (4, 5, 6, 14, 15, 16, 25, -5, -15, -16)] == [
        0, 0, 1, 1, 2, 2, 2, 0, -2, -2
    ]  # fmt: skip
    with pytest.raises(ValueError, match="positive"):
        divide_half_even(1, 0)


def test_cost_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="cached <= prompt"):
        _price().cost_micros(1, 2, 0)
    with pytest.raises(ValueError, match="completion >= 0"):
        _price().cost_micros(1, 0, -1)


# --- amounts as text ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("micros", "text"),
    [(0, "0.000000"), (150, "0.000150"), (150_000, "0.150000"), (12_345_678, "12.345678"),
     (-1, "-0.000001"), (-2_500_000, "-2.500000"), (10**18 + 1, "1000000000000.000001")],
)  # fmt: skip
def test_format_micros_is_exact(micros: int, text: str) -> None:
    assert format_micros(micros) == text


@pytest.mark.parametrize(
    ("text", "micros"),
    [("0.15", 150_000), ("0.150000", 150_000), ("1", 1_000_000), (".5", 500_000),
     ("2.", 2_000_000), ("0.000001", 1), ("12.3400000", 12_340_000), (" 3 ", 3_000_000),
     ("123456789012.123456", 123_456_789_012_123_456)],
)  # fmt: skip
def test_parse_amount_is_exact(text: str, micros: int) -> None:
    assert parse_amount(text) == micros


@pytest.mark.parametrize(
    "text",
    ["", ".", "-1", "1e3", "0x10", "1,5", "1.2.3", "0.0000001", "NaN", "inf", "\u0661", "1_000"],
)
def test_parse_amount_refuses_what_is_not_an_exact_amount(text: str) -> None:
    with pytest.raises(ValueError):
        parse_amount(text)


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"input": -1}, "input must be an integer"),
        ({"cached_input": 1.5}, "cached_input must be an integer"),
        ({"output": True}, "output must be an integer"),
        ({"output": MAX_PRICE_MICROS + 1}, "output must be an integer"),
        ({"currency": "usd"}, "currency must be 3 capital letters"),
        ({"currency": "US"}, "currency must be 3 capital letters"),
        ({"deployment": ""}, "deployment must be 1 to 128"),
        ({"deployment": "a b"}, "deployment must be 1 to 128"),
        ({"deployment": "x" * 129}, "deployment must be 1 to 128"),
        ({"deployment": "nul\x00"}, "deployment must be 1 to 128"),
        ({"effective_from": datetime(2025, 1, 1)}, "effective_from must be a timezone-aware"),
    ],
)
def test_invalid_prices_are_rejected(overrides: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = {
        "deployment": None,
        "input": 1,
        "cached_input": 1,
        "output": 1,
        "effective_from": T0,
        **overrides,
    }
    with pytest.raises(ValueError, match=message):
        PriceRecord(**values)


# --- which price is in force ------------------------------------------------------------------


def test_price_book_prefers_the_deployments_own_price_then_the_default() -> None:
    default_1 = _price(None, T0, input=1)
    default_2 = _price(None, T0 + 10 * DAY, input=2)
    own = _price("a", T0 + 5 * DAY, input=3)
    book = PriceBook([default_2, own, default_1])  # any order
    assert book.in_force("a", T0 - DAY) is None  # before any price
    assert book.in_force("a", T0) is default_1  # a price applies from its very start
    assert book.in_force("a", T0 + 5 * DAY - timedelta(microseconds=1)) is default_1
    assert book.in_force("a", T0 + 5 * DAY) is own
    assert book.in_force("a", T0 + 20 * DAY) is own  # its own price wins over a later default
    assert book.in_force("b", T0 + 20 * DAY) is default_2
    assert PriceBook([own]).in_force("b", T0 + 20 * DAY) is None


def test_store_sets_lists_and_answers_what_is_in_force(db: Database) -> None:
    store = PriceStore(db)
    default = store.set(None, 150_000, 75_000, 600_000, effective_from=T0)
    plus2 = timezone(timedelta(hours=2))
    own = store.set(
        "smollm2", 100_000, 50_000, 400_000, effective_from=datetime(2025, 3, 5, 2, tzinfo=plus2)
    )
    later = store.set(None, 200_000, 100_000, 800_000, effective_from=T0 + 10 * DAY)
    assert default.id is not None and default.created_at is not None
    assert own.effective_from == datetime(2025, 3, 5, tzinfo=UTC)
    assert own.effective_from.tzinfo is UTC
    assert [(p.deployment, p.input) for p in store.list()] == [
        (None, 150_000), (None, 200_000), ("smollm2", 100_000)
    ]  # fmt: skip
    assert store.list("smollm2") == [own]
    assert store.list("other") == []
    assert store.in_force("smollm2", T0 + DAY) == default
    assert store.in_force("smollm2", T0 + 4 * DAY) == own
    assert store.in_force("other", T0 + 11 * DAY) == later
    assert store.in_force("other", T0 - timedelta(seconds=1)) is None
    with pytest.raises(ValueError, match="timezone-aware"):
        store.in_force("other", datetime(2025, 3, 1))


def test_effective_from_defaults_to_now(db: Database) -> None:
    before = datetime.now(UTC)
    price = PriceStore(db).set("m", 1, 1, 1)
    assert before <= price.effective_from <= datetime.now(UTC)


def test_two_prices_cannot_start_at_the_same_time(db: Database) -> None:
    store = PriceStore(db)
    store.set(None, 1, 1, 1, effective_from=T0)
    store.set("m", 1, 1, 1, effective_from=T0)  # another deployment: fine
    with pytest.raises(PriceExists, match="the default already has a price from 2025-03-01"):
        store.set(None, 2, 2, 2, effective_from=T0)
    with pytest.raises(PriceExists, match="deployment 'm' already has a price"):
        store.set("m", 2, 2, 2, effective_from=T0)
    assert len(store.list()) == 2


def test_the_ledger_keeps_one_currency(db: Database) -> None:
    store = PriceStore(db)
    store.set(None, 1, 1, 1, effective_from=T0, currency="EUR")
    store.set("m", 1, 1, 1, effective_from=T0, currency="EUR")
    with pytest.raises(CurrencyMismatch, match="prices are in EUR"):
        store.set("m", 1, 1, 1, effective_from=T0 + DAY)  # USD by default
    assert {p.currency for p in store.list()} == {"EUR"}


def test_concurrent_first_prices_agree_on_one_currency(db: Database) -> None:
    store = PriceStore(db)
    barrier = threading.Barrier(4)
    errors: list[Exception] = []

    def set_price(i: int) -> None:
        barrier.wait()
        try:
            store.set(f"m{i}", 1, 1, 1, effective_from=T0, currency=("USD", "EUR")[i % 2])
        except CurrencyMismatch as exc:
            errors.append(exc)

    threads = [threading.Thread(target=set_price, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({p.currency for p in store.list()}) == 1
    assert len(errors) == 2


_RAW_PRICE = text(
    "INSERT INTO prices (deployment, currency, input, cached_input, output, effective_from,"
    " created_at) VALUES (:deployment, :currency, :input, :cached_input, :output,"
    " '2025-03-01 00:00:00', '2025-03-01 00:00:00')"
)
_VALID_PRICE = {"deployment": "m", "currency": "USD", "input": 1, "cached_input": 1, "output": 1}


@pytest.mark.parametrize(
    "bad",
    [{"input": -1}, {"cached_input": -1}, {"output": -1}, {"currency": "usd"},
     {"currency": "US"}, {"deployment": "m"}, {"deployment": None}],
    ids=["input<0", "cached<0", "output<0", "lowercase", "2 letters", "same start",
         "default twice"],
)  # fmt: skip
def test_database_constraints_on_prices(db: Database, bad: dict[str, Any]) -> None:
    with db.engine.begin() as conn:
        conn.execute(_RAW_PRICE, _VALID_PRICE)
        conn.execute(_RAW_PRICE, {**_VALID_PRICE, "deployment": None})
    with pytest.raises(IntegrityError), db.engine.begin() as conn:
        # "same start" and "default twice" repeat a (deployment, start) already stored.
        values = {**_VALID_PRICE, "deployment": "other", **bad}
        conn.execute(_RAW_PRICE, values)
