"""Usage queries over the ledger: token sums per time bucket and deployment.

Bucketing happens in SQL: a small construct truncates ``created_at`` to the bucket's UTC
boundary, spelled ``date_trunc`` on PostgreSQL and ``strftime`` on SQLite (which stores
naive UTC text), and the database groups and sums. Only the truncation differs between
dialects; the rest of the query is shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Literal

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.sql.visitors import InternalTraversal

from hotpool.billing.db import Database
from hotpool.billing.models import UsageEvent, UTCDateTime

BucketWidth = Literal["1m", "1h", "1d"]
BUCKET_WIDTHS: dict[str, timedelta] = {
    "1m": timedelta(minutes=1),
    "1h": timedelta(hours=1),
    "1d": timedelta(days=1),
}
# The ``deployment`` of rows summed over every deployment (group_by_deployment=False).
ALL_DEPLOYMENTS = "*"

_PG_UNITS = {"1m": "minute", "1h": "hour", "1d": "day"}
# Same text layout as SQLAlchemy's SQLite DATETIME, so the result type can parse it.
_SQLITE_FORMATS = {"1m": "%Y-%m-%d %H:%M:00", "1h": "%Y-%m-%d %H:00:00", "1d": "%Y-%m-%d 00:00:00"}


@dataclass(frozen=True)
class UsageBucketRow:
    """Token sums of the requests in [start, end) of one deployment (or ALL_DEPLOYMENTS)."""

    start: datetime
    end: datetime
    deployment: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class _utc_bucket(FunctionElement[datetime]):
    """``created_at`` truncated to the start of its UTC bucket."""

    type = UTCDateTime()
    inherit_cache = True
    # The width must be part of SQLAlchemy's statement cache key, or a cached "1d" query
    # would be reused for "1h".
    _traverse_internals: ClassVar[Any] = [
        *FunctionElement._traverse_internals,
        ("width", InternalTraversal.dp_string),
    ]

    def __init__(self, column: ColumnElement[Any], width: str) -> None:
        self.width = width
        super().__init__(column)


@compiles(_utc_bucket, "postgresql")
def _pg_bucket(element: _utc_bucket, compiler: SQLCompiler, **kw: Any) -> str:
    # The unit is rendered literally: PostgreSQL only accepts GROUP BY of a select expression
    # if it is the same expression, and two bind parameters would not be.
    column = compiler.process(element.clauses, **kw)
    return f"date_trunc('{_PG_UNITS[element.width]}', timezone('UTC', {column}))"


@compiles(_utc_bucket, "sqlite")
def _sqlite_bucket(element: _utc_bucket, compiler: SQLCompiler, **kw: Any) -> str:
    column = compiler.process(element.clauses, **kw)
    return f"strftime('{_SQLITE_FORMATS[element.width]}', {column})"


def floor_to_bucket(t: datetime, bucket_width: BucketWidth) -> datetime:
    """The UTC start of the bucket holding ``t``."""
    t = t.astimezone(UTC)
    if bucket_width == "1m":
        return t.replace(second=0, microsecond=0)
    if bucket_width == "1h":
        return t.replace(minute=0, second=0, microsecond=0)
    return t.replace(hour=0, minute=0, second=0, microsecond=0)


def bucket_starts(start: datetime, end: datetime, bucket_width: BucketWidth) -> list[datetime]:
    """Every bucket start from the one holding ``start`` up to, not including, ``end``.

    For callers that show empty buckets: :func:`usage_buckets` returns only non-empty ones.
    """
    _check_range(start, end, bucket_width)
    width = BUCKET_WIDTHS[bucket_width]
    t, starts = floor_to_bucket(start, bucket_width), []
    while t < end:
        starts.append(t)
        t += width
    return starts


def usage_buckets(
    db: Database,
    start: datetime,
    end: datetime,
    bucket_width: BucketWidth = "1d",
    deployment: str | None = None,
    group_by_deployment: bool = True,
    tenant_id: int | None = None,
) -> list[UsageBucketRow]:
    """Token sums of the events with ``start <= created_at < end``, per UTC-aligned bucket.

    Only non-empty buckets are returned (see :func:`bucket_starts` to fill the gaps), ordered
    by bucket start, then deployment name. A bucket's ``start`` is its UTC boundary, which may
    fall before ``start`` when ``start`` is not aligned; its sums still only count events in
    [start, end). With ``group_by_deployment=False`` each bucket is one row whose
    ``deployment`` is ``deployment`` if given, else :data:`ALL_DEPLOYMENTS`. ``tenant_id``
    keeps only that tenant's events (None: every tenant's).
    """
    _check_range(start, end, bucket_width)
    bucket = _utc_bucket(UsageEvent.created_at, bucket_width).label("bucket")
    columns: list[Any] = [
        bucket,
        func.count(UsageEvent.id),
        func.coalesce(func.sum(UsageEvent.prompt_tokens), 0),
        func.coalesce(func.sum(UsageEvent.cached_tokens), 0),
        func.coalesce(func.sum(UsageEvent.completion_tokens), 0),
    ]
    group_by: list[Any] = [bucket]
    if group_by_deployment:
        columns.append(UsageEvent.deployment)
        group_by.append(UsageEvent.deployment)
    stmt = (
        select(*columns)
        .where(UsageEvent.created_at >= start, UsageEvent.created_at < end)
        .group_by(*group_by)
        .order_by(*group_by)
    )
    if deployment is not None:
        stmt = stmt.where(UsageEvent.deployment == deployment)
    if tenant_id is not None:
        stmt = stmt.where(UsageEvent.tenant_id == tenant_id)
    width = BUCKET_WIDTHS[bucket_width]
    fixed_name = deployment if deployment is not None else ALL_DEPLOYMENTS
    with db.engine.connect() as conn:
        return [
            UsageBucketRow(
                start=row[0],
                end=row[0] + width,
                deployment=row[5] if group_by_deployment else fixed_name,
                requests=int(row[1]),
                prompt_tokens=int(row[2]),
                cached_tokens=int(row[3]),
                completion_tokens=int(row[4]),
            )
            for row in conn.execute(stmt)
        ]


def totals(db: Database, deployment: str | None = None) -> dict[str, int]:
    """All-time sums: requests, prompt, cached, completion and total tokens."""
    stmt = select(
        func.count(UsageEvent.id),
        func.coalesce(func.sum(UsageEvent.prompt_tokens), 0),
        func.coalesce(func.sum(UsageEvent.cached_tokens), 0),
        func.coalesce(func.sum(UsageEvent.completion_tokens), 0),
    )
    if deployment is not None:
        stmt = stmt.where(UsageEvent.deployment == deployment)
    with db.engine.connect() as conn:
        requests, prompt, cached, completion = conn.execute(stmt).one()
    return {
        "requests": int(requests),
        "prompt_tokens": int(prompt),
        "cached_tokens": int(cached),
        "completion_tokens": int(completion),
        "total_tokens": int(prompt) + int(completion),
    }


def _check_range(start: datetime, end: datetime, bucket_width: str) -> None:
    if bucket_width not in BUCKET_WIDTHS:
        raise ValueError(f"bucket_width must be one of {', '.join(BUCKET_WIDTHS)}")
    if start.utcoffset() is None or end.utcoffset() is None:
        raise ValueError("start and end must be timezone-aware")
    if end <= start:
        raise ValueError("end must be after start")
