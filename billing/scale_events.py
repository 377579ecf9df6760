"""The autoscaler's history: every change of a deployment's replica count, kept in SQL.

The autoscaler records a :class:`ScaleEventRecord` each time it changes a deployment's
desired replicas. A scale-up's cold start finishes later, so its duration (or the error that
stopped it) is filled in afterwards with :meth:`ScaleEventStore.set_cold_start`. Events keep
the deployment by name, so the history outlives a deleted deployment.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update

from hotpool.billing.db import Database
from hotpool.billing.deployments import NAME_MAX_LEN
from hotpool.billing.models import ScaleEvent, utcnow

REASON_MAX_LEN = 256


@dataclass(frozen=True)
class ScaleEventRecord:
    """One replica-count change of a deployment; invalid values raise ValueError.

    ``created_at`` None means "now" at recording time. ``id`` is set by the store and
    ignored when a record is written. ``tenant_id`` is the tenant owning the deployment at
    the time; ``phases`` the cold start's seconds by phase (fetch, load, ...), once known.
    """

    deployment: str
    from_replicas: int
    to_replicas: int
    reason: str
    cold_start_seconds: float | None = None
    error: str | None = None
    created_at: datetime | None = None
    id: int | None = None
    tenant_id: int | None = None
    phases: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if not self.deployment or len(self.deployment) > NAME_MAX_LEN:
            raise ValueError(f"deployment must be 1 to {NAME_MAX_LEN} characters")
        for name in ("from_replicas", "to_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.from_replicas == self.to_replicas:
            raise ValueError(
                f"from_replicas and to_replicas are both {self.to_replicas};"
                " a scale event must change the replica count"
            )
        if not self.reason or len(self.reason) > REASON_MAX_LEN:
            raise ValueError(f"reason must be 1 to {REASON_MAX_LEN} characters")
        _check_seconds(self.cold_start_seconds)
        _check_phases(self.phases)
        if self.created_at is not None and self.created_at.utcoffset() is None:
            raise ValueError("created_at must be timezone-aware")


def _check_seconds(value: float | None) -> None:
    # A NaN or infinite duration would poison every average computed from the table.
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"cold_start_seconds must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"cold_start_seconds must be >= 0, got {value!r}")


def _check_phases(phases: Mapping[str, float] | None) -> None:
    if phases is None:
        return
    for name, seconds in phases.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase names must be non-empty strings, got {name!r}")
        try:
            _check_seconds(seconds)
        except ValueError as exc:
            raise ValueError(f"phase {name!r}: {exc}") from None


class ScaleEventStore:
    """Records scale events into, and reads them back from, the ``scale_events`` table."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def record(self, event: ScaleEventRecord) -> int:
        """Store one event and return its id, which :meth:`set_cold_start` takes later."""
        row = ScaleEvent(
            deployment=event.deployment,
            from_replicas=event.from_replicas,
            to_replicas=event.to_replicas,
            reason=event.reason,
            cold_start_seconds=_float_or_none(event.cold_start_seconds),
            error=event.error,
            created_at=event.created_at or utcnow(),
            tenant_id=event.tenant_id,
            phases=_phases_json(event.phases),
        )
        with self.db.session() as session, session.begin():
            session.add(row)
        return row.id

    def set_cold_start(
        self,
        event_id: int,
        seconds: float | None,
        error: str | None = None,
        phases: Mapping[str, float] | None = None,
    ) -> None:
        """Set how long the event's cold start took, its phases, and why it failed if it did.

        All three are overwritten (None clears them). Raises KeyError for an unknown id.
        """
        _check_seconds(seconds)
        _check_phases(phases)
        stmt = (
            update(ScaleEvent)
            .where(ScaleEvent.id == event_id)
            .values(
                cold_start_seconds=_float_or_none(seconds),
                error=error,
                phases=_phases_json(phases),
            )
        )
        with self.db.engine.begin() as conn:
            result = conn.execute(stmt)
        if result.rowcount == 0:
            raise KeyError(event_id)

    def count(self, deployment: str | None = None, since: datetime | None = None) -> int:
        """How many events there are, optionally of one deployment and from ``since`` on."""
        if since is not None and since.utcoffset() is None:
            raise ValueError("since must be timezone-aware")
        stmt = select(func.count()).select_from(ScaleEvent)
        if deployment is not None:
            stmt = stmt.where(ScaleEvent.deployment == deployment)
        if since is not None:
            stmt = stmt.where(ScaleEvent.created_at >= since)
        with self.db.engine.connect() as conn:
            return int(conn.execute(stmt).scalar_one())

    def list(
        self,
        deployment: str | None = None,
        limit: int = 100,
        before_id: int | None = None,
        *,
        tenant_id: int | None = None,
        since: datetime | None = None,
    ) -> list[ScaleEventRecord]:
        """Up to ``limit`` events, newest first, optionally of one deployment, of one tenant
        and from ``since`` on.

        Ordered by id, not time: ids never repeat, so passing the last id of one page as
        ``before_id`` gives the next page with nothing skipped or repeated. A deployment's
        own history is its name's events of its tenant since its creation: a name can be
        deleted and taken again, by another tenant too, and the events stay under it.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be an integer >= 0, got {limit!r}")
        stmt = select(ScaleEvent).order_by(ScaleEvent.id.desc()).limit(limit)
        if deployment is not None:
            stmt = stmt.where(ScaleEvent.deployment == deployment)
        if tenant_id is not None:
            stmt = stmt.where(ScaleEvent.tenant_id == tenant_id)
        if since is not None:
            stmt = stmt.where(ScaleEvent.created_at >= since)
        if before_id is not None:
            stmt = stmt.where(ScaleEvent.id < before_id)
        with self.db.session() as session:
            return [_record(row) for row in session.scalars(stmt)]

    def between(
        self,
        start: datetime,
        end: datetime,
        *,
        tenant_id: int | None = None,
        limit: int = 1000,
    ) -> list[ScaleEventRecord]:
        """Events with ``start <= created_at < end``, oldest first, of one tenant (None: all).

        At most the ``limit`` latest of them: a chart of a month of flapping must stay small.
        """
        if start.utcoffset() is None or end.utcoffset() is None:
            raise ValueError("start and end must be timezone-aware")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be an integer >= 0, got {limit!r}")
        stmt = (
            select(ScaleEvent)
            .where(ScaleEvent.created_at >= start, ScaleEvent.created_at < end)
            .order_by(ScaleEvent.id.desc())
            .limit(limit)
        )
        if tenant_id is not None:
            stmt = stmt.where(ScaleEvent.tenant_id == tenant_id)
        with self.db.session() as session:
            return [_record(row) for row in reversed(session.scalars(stmt).all())]


def _phases_json(phases: Mapping[str, float] | None) -> str | None:
    return None if phases is None else json.dumps({k: float(v) for k, v in phases.items()})


def _float_or_none(value: float | None) -> float | None:
    return None if value is None else float(value)


def _record(row: ScaleEvent) -> ScaleEventRecord:
    return ScaleEventRecord(
        deployment=row.deployment,
        from_replicas=row.from_replicas,
        to_replicas=row.to_replicas,
        reason=row.reason,
        cold_start_seconds=row.cold_start_seconds,
        error=row.error,
        created_at=row.created_at,
        id=row.id,
        tenant_id=row.tenant_id,
        phases=None if row.phases is None else json.loads(row.phases),
    )
