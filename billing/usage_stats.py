"""What the dashboard shows beside token sums: requests by outcome, latency percentiles and
the last request of each deployment, over a time range of the ledger.

Percentiles are nearest-rank, computed in SQL with ``ORDER BY ... LIMIT 1 OFFSET k`` so the
same query runs on SQLite (which has no percentile function) and PostgreSQL, and no rows
leave the database. The ``(deployment, created_at)`` index bounds the sort to the range.
Correction rows are not requests and carry no timings, so both leave them out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select

from hotpool.billing.db import Database
from hotpool.billing.models import STATUSES, UsageEvent

PERCENTILES = (0.5, 0.95)


@dataclass(frozen=True)
class DeploymentStats:
    """One deployment's requests in a range: counts by status, and latency percentiles in
    seconds (None without a timed request). ``last_request_at`` is over all time."""

    deployment: str
    requests: dict[str, int]
    ttft_p50: float | None
    ttft_p95: float | None
    total_p50: float | None
    total_p95: float | None
    last_request_at: datetime | None


def _range(stmt: Any, start: datetime, end: datetime, tenant_id: int | None) -> Any:
    if start.utcoffset() is None or end.utcoffset() is None:
        raise ValueError("start and end must be timezone-aware")
    stmt = stmt.where(
        UsageEvent.created_at >= start,
        UsageEvent.created_at < end,
        UsageEvent.corrects_id.is_(None),
    )
    if tenant_id is not None:
        stmt = stmt.where(UsageEvent.tenant_id == tenant_id)
    return stmt


def requests_by_status(
    db: Database, start: datetime, end: datetime, *, tenant_id: int | None = None
) -> dict[str, dict[str, int]]:
    """{deployment: {status: requests}} for requests in [start, end); every status present."""
    stmt = _range(
        select(UsageEvent.deployment, UsageEvent.status, func.count()).group_by(
            UsageEvent.deployment, UsageEvent.status
        ),
        start,
        end,
        tenant_id,
    )
    out: dict[str, dict[str, int]] = {}
    with db.engine.connect() as conn:
        for deployment, status, n in conn.execute(stmt):
            out.setdefault(deployment, dict.fromkeys(STATUSES, 0))[status] = int(n)
    return out


def percentile(
    db: Database,
    column: Any,
    q: float,
    start: datetime,
    end: datetime,
    *,
    deployment: str,
    tenant_id: int | None = None,
    version: int | None = None,
) -> float | None:
    """Nearest-rank ``q`` percentile of ``column`` (a UsageEvent timing) over one deployment's
    requests in [start, end) that have it (of one ``version`` if given); None when none has."""
    if not 0 < q <= 1:
        raise ValueError(f"q must be in (0, 1], got {q}")
    where = [UsageEvent.deployment == deployment, column.is_not(None)]
    if version is not None:
        where.append(UsageEvent.version == version)
    base = _range(select(func.count()), start, end, tenant_id).where(*where)
    with db.engine.connect() as conn:
        n = int(conn.execute(base.select_from(UsageEvent)).scalar_one())
        if n == 0:
            return None
        rank = math.ceil(q * n) - 1  # nearest rank, 0-based
        stmt = (
            _range(select(column), start, end, tenant_id)
            .where(*where)
            .order_by(column)
            .offset(rank)
            .limit(1)
        )
        return float(conn.execute(stmt).scalar_one())


def last_requests(db: Database, *, tenant_id: int | None = None) -> dict[str, datetime]:
    """{deployment: time of its latest request}, over all time."""
    stmt = (
        select(UsageEvent.deployment, func.max(UsageEvent.created_at))
        .where(UsageEvent.corrects_id.is_(None))
        .group_by(UsageEvent.deployment)
    )
    if tenant_id is not None:
        stmt = stmt.where(UsageEvent.tenant_id == tenant_id)
    with db.engine.connect() as conn:
        # max() keeps the column's type, so SQLite's text comes back as an aware datetime.
        return {deployment: at for deployment, at in conn.execute(stmt)}


def deployment_stats(
    db: Database, start: datetime, end: datetime, *, tenant_id: int | None = None
) -> list[DeploymentStats]:
    """Per deployment with requests in [start, end) or ever: counts, percentiles, last use."""
    by_status = requests_by_status(db, start, end, tenant_id=tenant_id)
    last = last_requests(db, tenant_id=tenant_id)
    stats = []
    for name in sorted(set(by_status) | set(last)):
        timed: dict[str, float | None] = {}
        timings = (("ttft", UsageEvent.ttft_seconds), ("total", UsageEvent.total_seconds))
        for label, column in timings:
            for q in PERCENTILES:
                key = f"{label}_p{round(q * 100)}"
                timed[key] = (
                    percentile(db, column, q, start, end, deployment=name, tenant_id=tenant_id)
                    if name in by_status
                    else None
                )
        stats.append(
            DeploymentStats(
                deployment=name,
                requests=by_status.get(name, dict.fromkeys(STATUSES, 0)),
                last_request_at=last.get(name),
                **timed,  # type: ignore[arg-type]
            )
        )
    return stats


@dataclass(frozen=True)
class VersionStats:
    """One deployment version's requests in a range: counts by status, tokens, and latency
    percentiles in seconds (None without a timed request)."""

    version: int | None
    requests: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_p50: float | None
    ttft_p95: float | None
    total_p50: float | None
    total_p95: float | None


def version_stats(
    db: Database,
    start: datetime,
    end: datetime,
    *,
    deployment: str,
    tenant_id: int | None = None,
) -> list[VersionStats]:
    """Per version of ``deployment`` that served requests in [start, end), by version: what
    a canary is judged on, side by side with the stable version."""
    stmt = _range(
        select(UsageEvent.version, UsageEvent.status, func.count()).group_by(
            UsageEvent.version, UsageEvent.status
        ),
        start,
        end,
        tenant_id,
    ).where(UsageEvent.deployment == deployment)
    # Token sums include corrections (corrected totals), as every usage sum does.
    tokens = (
        select(
            UsageEvent.version,
            func.coalesce(func.sum(UsageEvent.prompt_tokens), 0),
            func.coalesce(func.sum(UsageEvent.cached_tokens), 0),
            func.coalesce(func.sum(UsageEvent.completion_tokens), 0),
        )
        .where(
            UsageEvent.deployment == deployment,
            UsageEvent.created_at >= start,
            UsageEvent.created_at < end,
        )
        .group_by(UsageEvent.version)
    )
    if tenant_id is not None:
        tokens = tokens.where(UsageEvent.tenant_id == tenant_id)
    counts: dict[int | None, dict[str, int]] = {}
    with db.engine.connect() as conn:
        for version, status, n in conn.execute(stmt):
            counts.setdefault(version, dict.fromkeys(STATUSES, 0))[status] = int(n)
        sums = {v: (int(p), int(c), int(o)) for v, p, c, o in conn.execute(tokens)}
    out = []
    for version in sorted(counts, key=lambda v: v or 0):
        timed: dict[str, float | None] = {}
        for label, column in (
            ("ttft", UsageEvent.ttft_seconds),
            ("total", UsageEvent.total_seconds),
        ):
            for q in PERCENTILES:
                # Requests from before versions existed (NULL) get no percentiles of their own.
                timed[f"{label}_p{round(q * 100)}"] = None if version is None else percentile(
                    db, column, q, start, end, deployment=deployment, tenant_id=tenant_id,
                    version=version,
                )  # fmt: skip
        p, c, o = sums.get(version, (0, 0, 0))
        out.append(VersionStats(version, counts[version], p, c, o, **timed))
    return out
