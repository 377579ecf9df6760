"""Usage queries over the ledger: token and cost sums per time bucket, deployment and key.

Bucketing happens in SQL: a small construct truncates ``created_at`` to the bucket's UTC
boundary, spelled ``date_trunc`` on PostgreSQL and ``strftime`` on SQLite (which stores
naive UTC text), and the database groups and sums. Only the truncation differs between
dialects; the rest of the query is shared.

Correction rows (deltas) are summed with the events they correct, so sums are the corrected
usage; they are not requests, so request counts leave them out. Costs are summed as
integers in SQL: exact, whatever the number of events.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Literal

from sqlalchemy import ColumnElement, case, func, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.sql.visitors import InternalTraversal

from hotpool.billing.db import Database
from hotpool.billing.models import ApiKey, UsageEvent, UTCDateTime

BucketWidth = Literal["1m", "1h", "1d"]
BUCKET_WIDTHS: dict[str, timedelta] = {
    "1m": timedelta(minutes=1),
    "1h": timedelta(hours=1),
    "1d": timedelta(days=1),
}
# What usage can be grouped by, besides the time bucket.
GROUPS = ("deployment", "api_key", "version")

_PG_UNITS = {"1m": "minute", "1h": "hour", "1d": "day"}
# Same text layout as SQLAlchemy's SQLite DATETIME, so the result type can parse it.
_SQLITE_FORMATS = {"1m": "%Y-%m-%d %H:%M:00", "1h": "%Y-%m-%d %H:00:00", "1d": "%Y-%m-%d 00:00:00"}


@dataclass(frozen=True)
class UsageBucketRow:
    """Sums over the events in [start, end) of one group.

    ``deployment`` is None unless grouped by deployment; ``api_key_id`` and ``api_key`` (the
    key's prefix) are None unless grouped by API key, and also for requests made without one.
    ``cost_micros`` sums the costs in integer micro-units of ``currency``; both are None when
    no event of the group had a price in force.
    """

    start: datetime
    end: datetime
    deployment: str | None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    api_key_id: int | None = None
    api_key: str | None = None
    cost_micros: int | None = None
    currency: str | None = None
    version: int | None = None  # grouped by version: the deployment version that served

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
    *,
    deployments: Collection[str] | None = None,
    group_by: Collection[str] = ("deployment",),
    tenant_id: int | None = None,
) -> list[UsageBucketRow]:
    """Token and cost sums of the events with ``start <= created_at < end``, per UTC-aligned
    bucket and group.

    ``group_by`` holds any of :data:`GROUPS` (none: one row per bucket). Only non-empty
    buckets are returned (see :func:`bucket_starts` to fill the gaps), ordered by bucket
    start, then deployment, then key prefix. A bucket's ``start`` is its UTC boundary, which
    may fall before ``start`` when ``start`` is not aligned; its sums still only count events
    in [start, end). ``deployments`` keeps only those deployments' events and ``tenant_id``
    only that tenant's (None: all).
    """
    _check_range(start, end, bucket_width)
    unknown = sorted(set(group_by) - set(GROUPS))
    if unknown:
        raise ValueError(f"cannot group by {unknown[0]!r}; groups are {', '.join(GROUPS)}")
    bucket = _utc_bucket(UsageEvent.created_at, bucket_width).label("bucket")
    groups: dict[str, Any] = {"bucket": bucket}
    if "deployment" in group_by:
        groups["deployment"] = UsageEvent.deployment
    if "api_key" in group_by:
        groups["api_key_id"] = UsageEvent.api_key_id
        groups["api_key"] = ApiKey.prefix
    if "version" in group_by:
        groups["version"] = UsageEvent.version
    stmt = (
        select(*(col.label(name) for name, col in groups.items()), *_sums())
        .where(UsageEvent.created_at >= start, UsageEvent.created_at < end)
        .group_by(*groups.values())
    )
    if "api_key" in group_by:
        stmt = stmt.outerjoin(ApiKey, ApiKey.id == UsageEvent.api_key_id)
    if deployments is not None:
        stmt = stmt.where(UsageEvent.deployment.in_(list(deployments)))
    if tenant_id is not None:
        stmt = stmt.where(UsageEvent.tenant_id == tenant_id)
    width = BUCKET_WIDTHS[bucket_width]
    with db.engine.connect() as conn:
        rows = [
            UsageBucketRow(
                start=row.bucket,
                end=row.bucket + width,
                deployment=row.deployment if "deployment" in groups else None,
                api_key_id=row.api_key_id if "api_key" in groups else None,
                api_key=row.api_key if "api_key" in groups else None,
                version=row.version if "version" in groups else None,
                **_sums_of(row),
            )
            for row in conn.execute(stmt)
        ]
    # Sorted here: SQLite and PostgreSQL put NULLs (no key) at opposite ends.
    return sorted(
        rows,
        key=lambda r: (
            r.start,
            r.deployment or "",
            r.api_key or "",
            r.api_key_id or 0,
            r.version or 0,
        ),
    )


def totals(db: Database, deployment: str | None = None) -> dict[str, Any]:
    """All-time sums: requests, prompt, cached, completion and total tokens, and cost (in
    micro-units of ``currency``; both None when nothing was priced)."""
    stmt = select(*_sums())
    if deployment is not None:
        stmt = stmt.where(UsageEvent.deployment == deployment)
    with db.engine.connect() as conn:
        sums = _sums_of(conn.execute(stmt).one())
    return {**sums, "total_tokens": sums["prompt_tokens"] + sums["completion_tokens"]}


def _sums() -> list[Any]:
    return [
        # Corrections adjust a request's counts; they are not requests themselves.
        func.count(case((UsageEvent.corrects_id.is_(None), 1))).label("requests"),
        func.coalesce(func.sum(UsageEvent.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(UsageEvent.cached_tokens), 0).label("cached_tokens"),
        func.coalesce(func.sum(UsageEvent.completion_tokens), 0).label("completion_tokens"),
        func.sum(UsageEvent.cost_micros).label("cost_micros"),
        func.min(UsageEvent.currency).label("currency"),
        func.max(UsageEvent.currency).label("max_currency"),
    ]


def _sums_of(row: Any) -> dict[str, Any]:
    if row.currency != row.max_currency:
        # PriceStore keeps the ledger to one currency; a sum across two would be wrong.
        raise ValueError(f"usage mixes currencies {row.currency} and {row.max_currency}")
    return {
        "requests": int(row.requests),
        "prompt_tokens": int(row.prompt_tokens),
        "cached_tokens": int(row.cached_tokens),
        "completion_tokens": int(row.completion_tokens),
        # PostgreSQL sums a BIGINT into a NUMERIC (a Decimal here): exact, made an int.
        "cost_micros": None if row.cost_micros is None else int(row.cost_micros),
        "currency": row.currency,
    }


def _check_range(start: datetime, end: datetime, bucket_width: str) -> None:
    if bucket_width not in BUCKET_WIDTHS:
        raise ValueError(f"bucket_width must be one of {', '.join(BUCKET_WIDTHS)}")
    if start.utcoffset() is None or end.utcoffset() is None:
        raise ValueError("start and end must be timezone-aware")
    if end <= start:
        raise ValueError("end must be after start")
