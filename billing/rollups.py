"""Hourly usage rollups: sums of the usage events per UTC hour, tenant and deployment.

Rollups are derived data. :func:`rebuild` throws away the rollups of a range of hours and
recomputes them from ``usage_events`` in one transaction, in SQL (``INSERT ... SELECT ...
GROUP BY``), so a rebuild is exact and idempotent whatever it replaces. :func:`check`
holds them to the invariant "rollup = sum of events" and lists every difference.

The sums mean what :mod:`hotpool.billing.usage` means: token sums include correction rows
(deltas), so they are corrected totals; ``requests`` counts only original events;
``cost_micros`` sums the costs of the priced events and is NULL, with ``currency``, when no
event of the group had a price in force.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Select,
    case,
    delete,
    func,
    insert,
    literal,
    select,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from hotpool.billing.db import Database
from hotpool.billing.models import UsageEvent, UsageRollupHourly, UTCDateTime, utcnow

HOUR = timedelta(hours=1)
# What check compares, in this order: the columns of a rollup that come from the events.
FIELDS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost_micros",
    "currency",
)


@dataclass(frozen=True)
class Mismatch:
    """One way a rollup differs from the sums of its events.

    ``field`` is one of :data:`FIELDS`, or ``"row"`` when one side has no row at all for
    the hour, tenant and deployment; then the absent side is None and the other holds its
    request count.
    """

    hour: datetime
    tenant_id: int
    deployment: str
    field: str
    rollup: int | str | None
    events: int | str | None

    def __str__(self) -> str:
        where = f"{self.hour:%Y-%m-%d %H:00} UTC tenant {self.tenant_id} {self.deployment}"
        if self.field == "row" and self.rollup is None:
            return f"{where}: no rollup, events have {self.events} requests"
        if self.field == "row":
            return f"{where}: rollup of {self.rollup} requests has no events"
        return f"{where}: {self.field} is {self.rollup} in the rollup, {self.events} in events"


class _utc_hour(FunctionElement[datetime]):
    """A timestamp column truncated to the start of its UTC hour, in the column's own
    storage form, so it can be both compared with and written to a ``UTCDateTime``.

    Not :mod:`hotpool.billing.usage`'s bucket construct: that one is for reading back, and
    yields a naive timestamp on PostgreSQL and text without microseconds on SQLite, which a
    timestamptz column would shift by the session's zone and SQLite would compare as text.
    """

    type = UTCDateTime()
    inherit_cache = True

    def __init__(self, column: ColumnElement[Any]) -> None:
        super().__init__(column)


@compiles(_utc_hour, "postgresql")
def _pg_hour(element: _utc_hour, compiler: SQLCompiler, **kw: Any) -> str:
    column = compiler.process(element.clauses, **kw)
    return f"timezone('UTC', date_trunc('hour', timezone('UTC', {column})))"


@compiles(_utc_hour, "sqlite")
def _sqlite_hour(element: _utc_hour, compiler: SQLCompiler, **kw: Any) -> str:
    # The layout SQLAlchemy's SQLite DATETIME stores, microseconds included.
    column = compiler.process(element.clauses, **kw)
    return f"strftime('%Y-%m-%d %H:00:00.000000', {column})"


def floor_hour(t: datetime) -> datetime:
    return t.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def ceil_hour(t: datetime) -> datetime:
    floor = floor_hour(t)
    return floor if floor == t else floor + HOUR


def rebuild(db: Database, start: datetime | None, end: datetime | None) -> int:
    """Recompute the rollups of every UTC hour overlapping [start, end) (None: unbounded)
    from the events.

    The hours' old rollups are deleted and the new ones inserted in one transaction, and
    concurrent rebuilds serialize, so readers see either the old rollups or the new ones.
    Returns the number of rollup rows written. Raises ValueError for a naive time or an
    empty range, or if a group's events mix currencies (the ledger keeps one).
    """
    lo, hi = _hours(start, end)
    r = UsageRollupHourly
    stale = delete(r)
    if lo is not None:
        stale = stale.where(r.hour >= lo)
    if hi is not None:
        stale = stale.where(r.hour < hi)
    sums = _event_sums(lo, hi).add_columns(literal(utcnow(), UTCDateTime()).label("rebuilt_at"))
    names = ["hour", "tenant_id", "deployment", *FIELDS, "rebuilt_at"]
    with db.engine.begin() as conn:
        _lock(db, conn)
        _refuse_mixed_currencies(conn, lo, hi)
        conn.execute(stale)
        return conn.execute(insert(r).from_select(names, sums)).rowcount


def rebuild_all(db: Database) -> int:
    """Recompute every rollup from every event; returns the rows written."""
    return rebuild(db, None, None)


def check(
    db: Database, start: datetime | None = None, end: datetime | None = None
) -> list[Mismatch]:
    """Every difference between the rollups of the hours overlapping [start, end) (None:
    unbounded) and fresh sums of those hours' events, ordered by hour, tenant and deployment.

    An empty list means the invariant holds. Hours with events but no rollup (not rebuilt
    since the events came) are reported with ``field="row"``.
    """
    lo, hi = _hours(start, end)
    r = UsageRollupHourly
    rollups = select(r.hour, r.tenant_id, r.deployment, *(getattr(r, f) for f in FIELDS))
    if lo is not None:
        rollups = rollups.where(r.hour >= lo)
    if hi is not None:
        rollups = rollups.where(r.hour < hi)
    with db.engine.connect() as conn:
        # Both reads from one snapshot, so an event arriving between them is no mismatch.
        if db.is_sqlite:
            conn.exec_driver_sql("BEGIN")
        else:
            conn.execution_options(isolation_level="REPEATABLE READ")
        have = {tuple(row[:3]): tuple(row[3:]) for row in conn.execute(rollups)}
        want = {}
        for row in conn.execute(_event_sums(lo, hi, with_max_currency=True)):
            values = [None if v is None else int(v) for v in row[3:8]]
            currency = row.currency if row.currency == row.max_currency else "mixed"
            want[tuple(row[:3])] = (*values, currency)
    mismatches = []
    for key in sorted(have.keys() | want.keys()):
        got, expected = have.get(key), want.get(key)
        if got is None or expected is None:
            count = [None if v is None else v[0] for v in (got, expected)]
            mismatches.append(Mismatch(*key, "row", *count))
            continue
        mismatches += [
            Mismatch(*key, field, a, b)
            for field, a, b in zip(FIELDS, got, expected, strict=True)
            if a != b
        ]
    return mismatches


def _event_sums(
    lo: datetime | None, hi: datetime | None, *, with_max_currency: bool = False
) -> Select[Any]:
    """Per hour, tenant and deployment: the rollup's columns summed from the events."""
    e = UsageEvent
    hour = _utc_hour(e.created_at).label("hour")
    stmt = select(
        hour,
        e.tenant_id,
        e.deployment,
        # Corrections adjust a request's counts; they are not requests themselves.
        func.count(case((e.corrects_id.is_(None), 1))).label("requests"),
        func.coalesce(func.sum(e.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(e.cached_tokens), 0).label("cached_tokens"),
        func.coalesce(func.sum(e.completion_tokens), 0).label("completion_tokens"),
        func.sum(e.cost_micros).label("cost_micros"),
        func.min(e.currency).label("currency"),
    ).group_by(hour, e.tenant_id, e.deployment)
    if with_max_currency:
        stmt = stmt.add_columns(func.max(e.currency).label("max_currency"))
    if lo is not None:
        stmt = stmt.where(e.created_at >= lo)
    if hi is not None:
        stmt = stmt.where(e.created_at < hi)
    return stmt


def _refuse_mixed_currencies(conn: Connection, lo: datetime | None, hi: datetime | None) -> None:
    sums = _event_sums(lo, hi, with_max_currency=True).subquery()
    mixed = conn.execute(
        select(sums.c.hour, sums.c.deployment).where(sums.c.currency != sums.c.max_currency)
    ).first()
    if mixed is not None:
        raise ValueError(
            f"usage of {mixed.deployment} in the hour of {mixed.hour:%Y-%m-%d %H:00} UTC"
            " mixes currencies"
        )


def _lock(db: Database, conn: Connection) -> None:
    """Serialize rebuilds: two interleaved ones would insert the same rows twice."""
    if db.is_sqlite:
        # pysqlite opens a transaction only at the first write; take the write lock now.
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("LOCK TABLE usage_rollups_hourly IN SHARE ROW EXCLUSIVE MODE")


def _hours(start: datetime | None, end: datetime | None) -> tuple[datetime | None, datetime | None]:
    """The hour-aligned bounds of the hours overlapping [start, end)."""
    if (start is not None and start.utcoffset() is None) or (
        end is not None and end.utcoffset() is None
    ):
        raise ValueError("start and end must be timezone-aware")
    if start is not None and end is not None and end <= start:
        raise ValueError("end must be after start")
    return (
        None if start is None else floor_hour(start),
        None if end is None else ceil_hour(end),
    )
