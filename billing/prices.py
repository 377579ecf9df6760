"""Prices per million tokens, which one is in force when, and what a request costs.

Money is integer micro-units of a currency everywhere (``150000`` is $0.15): no float ever
holds an amount, so sums in SQL and in Python agree to the last micro-unit. A price is in
force from its ``effective_from`` until the next one of the same deployment; a deployment
without a price of its own in force at a time uses the default price (``deployment`` None)
in force then, and with neither a request has no cost (NULL, not zero: "not priced" is not
"free").

The ledger holds one currency: sums of costs in two currencies would mean nothing, so
:class:`PriceStore` refuses a price in a currency other than the one already used.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Row, or_, select
from sqlalchemy.exc import IntegrityError

from hotpool.billing.db import Database
from hotpool.billing.models import Price, utcnow

MICROS = 1_000_000  # micro-units per unit of currency
PER_TOKENS = 1_000_000  # prices are per million tokens
# $1,000,000 per 1M tokens: far above any real price, and small enough that a request's
# cost (tokens < 2^31 each) stays well inside a BIGINT.
MAX_PRICE_MICROS = 10**12
DEFAULT_CURRENCY = "USD"
DEPLOYMENT_MAX_LEN = 128
_CURRENCY = re.compile(r"[A-Z]{3}")
# Digits only ([0-9], not \d: no other scripts' digits), at least one, one optional point.
_AMOUNT = re.compile(r"(?=\.?[0-9])(?P<units>[0-9]*)(?:\.(?P<fraction>[0-9]*))?")


def check_deployment(name: object) -> str:
    """``name`` if it can name a deployment (1 to 128 printable ASCII characters, no
    spaces), else ValueError."""
    if not (
        isinstance(name, str)
        and 1 <= len(name) <= DEPLOYMENT_MAX_LEN
        and all(" " < ch <= "~" for ch in name)
    ):
        raise ValueError(
            f"deployment must be 1 to {DEPLOYMENT_MAX_LEN} printable ASCII characters without"
            f" spaces, or none for the default price; got {name!r}"
        )
    return name


class PriceExists(Exception):
    """A price of this deployment (or the default) already starts at this time."""

    def __init__(self, deployment: str | None, effective_from: datetime) -> None:
        who = f"deployment {deployment!r}" if deployment is not None else "the default"
        super().__init__(f"{who} already has a price from {effective_from.isoformat()}")
        self.deployment = deployment
        self.effective_from = effective_from


class CurrencyMismatch(ValueError):
    """A price in a currency other than the ledger's."""


@dataclass(frozen=True)
class PriceRecord:
    """Prices in micro-units of ``currency`` per million tokens, from ``effective_from`` on.

    ``deployment`` None is the default price. ``id`` and ``created_at`` are set by the store.
    Invalid values raise ValueError on construction.
    """

    deployment: str | None
    input: int
    cached_input: int
    output: int
    effective_from: datetime
    currency: str = DEFAULT_CURRENCY
    id: int | None = None
    created_at: datetime | None = None

    def __post_init__(self) -> None:
        if self.deployment is not None:
            check_deployment(self.deployment)
        if not isinstance(self.currency, str) or not _CURRENCY.fullmatch(self.currency):
            raise ValueError(
                f"currency must be 3 capital letters (ISO 4217), got {self.currency!r}"
            )
        for field in ("input", "cached_input", "output"):
            value = getattr(self, field)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_PRICE_MICROS
            ):
                raise ValueError(
                    f"{field} must be an integer number of micro-units per million tokens"
                    f" from 0 to {MAX_PRICE_MICROS}, got {value!r}"
                )
        if not isinstance(self.effective_from, datetime) or self.effective_from.utcoffset() is None:
            raise ValueError("effective_from must be a timezone-aware datetime")

    def cost_micros(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """The cost of one request, in micro-units: see :func:`cost_micros`."""
        return cost_micros(self, prompt_tokens, cached_tokens, completion_tokens)


def cost_micros(
    price: PriceRecord, prompt_tokens: int, cached_tokens: int, completion_tokens: int
) -> int:
    """What a request costs at ``price``, in integer micro-units of its currency.

    The exact cost is ``((prompt - cached) * input + cached * cached_input + completion *
    output) / 1,000,000`` micro-units, a rational number; it is rounded once, to the nearest
    micro-unit, halves to even (banker's rounding), in integer arithmetic. Each request is
    off by at most half a micro-unit, and half-even rounding does not lean either way, so
    over many requests the errors cancel rather than pile up; the stored integers then sum
    exactly. Counts must satisfy ``0 <= cached <= prompt`` and ``completion >= 0``.
    """
    if not (0 <= cached_tokens <= prompt_tokens and completion_tokens >= 0):
        raise ValueError("token counts must satisfy 0 <= cached <= prompt and completion >= 0")
    numerator = (
        (prompt_tokens - cached_tokens) * price.input
        + cached_tokens * price.cached_input
        + completion_tokens * price.output
    )
    return divide_half_even(numerator, PER_TOKENS)


def divide_half_even(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` rounded to the nearest integer, halves to even."""
    if denominator <= 0:
        raise ValueError("denominator must be positive")
    quotient, remainder = divmod(numerator, denominator)  # floor division: remainder >= 0
    twice = 2 * remainder
    if twice > denominator or (twice == denominator and quotient % 2 == 1):
        quotient += 1
    return quotient


def format_micros(micros: int) -> str:
    """Micro-units as an exact decimal amount with six places: 150 -> ``"0.000150"``."""
    units, fraction = divmod(abs(micros), MICROS)
    return f"{'-' if micros < 0 else ''}{units}.{fraction:06d}"


def parse_amount(text: str) -> int:
    """A decimal amount of currency (``"0.15"``) as exact micro-units (150000).

    Parsed digit by digit, never through a float (nor a Decimal context, which rounds past
    28 digits). ValueError for anything but a plain non-negative decimal with at most six
    decimal places: a seventh would be a fraction of a micro-unit, silently lost.
    """
    match = _AMOUNT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a non-negative decimal amount such as 0.15")
    units, fraction = match["units"] or "0", (match["fraction"] or "").rstrip("0")
    if len(fraction) > 6:
        raise ValueError(f"{text!r} has more than 6 decimal places (a micro-unit is 0.000001)")
    return int(units) * MICROS + int(fraction.ljust(6, "0"))


class PriceBook:
    """A set of prices, loaded once, that answers "which price was in force" without SQL.

    The ledger loads one per batch it records, so pricing N events costs one query.
    """

    def __init__(self, prices: Iterable[PriceRecord]) -> None:
        by_deployment: dict[str | None, list[PriceRecord]] = {}
        for price in prices:
            by_deployment.setdefault(price.deployment, []).append(price)
        self._prices = {
            k: sorted(v, key=lambda p: p.effective_from) for k, v in by_deployment.items()
        }
        self._starts = {k: [p.effective_from for p in v] for k, v in self._prices.items()}

    @classmethod
    def load(cls, conn: Connection, deployments: Collection[str] | None = None) -> PriceBook:
        """The prices of ``deployments`` (every deployment's if None) and the defaults."""
        stmt = select(Price.__table__)
        if deployments is not None:
            stmt = stmt.where(or_(Price.deployment.is_(None), Price.deployment.in_(deployments)))
        return cls(_record(row) for row in conn.execute(stmt))

    def in_force(self, deployment: str, at: datetime) -> PriceRecord | None:
        """The deployment's own latest price from ``at`` or before, else the default's."""
        return self._latest(deployment, at) or self._latest(None, at)

    def _latest(self, deployment: str | None, at: datetime) -> PriceRecord | None:
        starts = self._starts.get(deployment)
        if not starts:
            return None
        i = bisect.bisect_right(starts, at)
        return self._prices[deployment][i - 1] if i else None


class PriceStore:
    """Set and read prices. A price is never changed or deleted: a new one supersedes it."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def set(
        self,
        deployment: str | None,
        input: int,
        cached_input: int,
        output: int,
        effective_from: datetime | None = None,
        currency: str = DEFAULT_CURRENCY,
    ) -> PriceRecord:
        """Add a price in force from ``effective_from`` (default: now) on.

        ``deployment`` None sets the default price. Amounts are integer micro-units per
        million tokens. Raises ValueError for invalid values, CurrencyMismatch for a currency
        other than the ledger's, PriceExists if one already starts at that very time.
        Events already recorded keep the cost they were recorded with, even when
        ``effective_from`` lies before them: cost is fixed at ingest.
        """
        price = PriceRecord(
            deployment, input, cached_input, output, effective_from or utcnow(), currency
        )
        row = Price(
            deployment=price.deployment,
            currency=price.currency,
            input=price.input,
            cached_input=price.cached_input,
            output=price.output,
            effective_from=price.effective_from.astimezone(UTC),
            created_at=utcnow(),
        )
        try:
            with self.db.session() as session, session.begin():
                self._lock(session.connection())
                used = session.scalar(select(Price.currency).where(Price.currency != currency))
                if used is not None:
                    raise CurrencyMismatch(
                        f"the ledger's prices are in {used}; a price in {currency} would make"
                        " sums of costs meaningless"
                    )
                session.add(row)
        except IntegrityError as exc:
            if self._exists(price.deployment, price.effective_from):
                raise PriceExists(price.deployment, price.effective_from) from exc
            raise
        return _record(row)

    def _lock(self, conn: Connection) -> None:
        """Serialize price writers, so two first prices cannot pick two currencies."""
        if self.db.is_sqlite:
            # pysqlite opens a transaction only at the first write; take the write lock now.
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("LOCK TABLE prices IN SHARE ROW EXCLUSIVE MODE")

    def _exists(self, deployment: str | None, effective_from: datetime) -> bool:
        who = Price.deployment.is_(None) if deployment is None else Price.deployment == deployment
        stmt = select(Price.id).where(who, Price.effective_from == effective_from)
        with self.db.engine.connect() as conn:
            return conn.execute(stmt).first() is not None

    def list(self, deployment: str | None = None) -> list[PriceRecord]:
        """Every price (or only ``deployment``'s own), defaults first, then by deployment
        and start."""
        stmt = select(Price.__table__)
        if deployment is not None:
            stmt = stmt.where(Price.deployment == deployment)
        with self.db.engine.connect() as conn:
            prices = [_record(row) for row in conn.execute(stmt)]
        return sorted(
            prices, key=lambda p: (p.deployment is not None, p.deployment or "", p.effective_from)
        )

    def in_force(self, deployment: str, at: datetime) -> PriceRecord | None:
        """The price a request of ``deployment`` at ``at`` is billed at, or None."""
        if at.utcoffset() is None:
            raise ValueError("at must be timezone-aware")
        with self.db.engine.connect() as conn:
            return PriceBook.load(conn, [deployment]).in_force(deployment, at)


def _record(row: Price | Row[Any]) -> PriceRecord:
    return PriceRecord(
        deployment=row.deployment,
        input=row.input,
        cached_input=row.cached_input,
        output=row.output,
        effective_from=row.effective_from,
        currency=row.currency,
        id=row.id,
        created_at=row.created_at,
    )
