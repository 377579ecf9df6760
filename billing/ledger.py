"""The usage ledger: one append-only row per request, recorded exactly once.

The control plane records a :class:`UsageRecord` for every request whatever its outcome.
Delivery may repeat (retries, a replayed spool), so recording is idempotent by
``request_id``: a replay is a no-op, done in one ``INSERT ... ON CONFLICT DO NOTHING`` so two
writers racing on the same id cannot both insert it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select

from hotpool.billing.db import Database
from hotpool.billing.models import DEFAULT_TENANT_ID, STATUSES, UsageEvent, utcnow

REQUEST_ID_MAX_LEN = 64
# Rows per INSERT: 17 columns each stays far below SQLite's bound-parameter limit.
_BATCH = 500


@dataclass(frozen=True)
class UsageRecord:
    """The billable usage of one request, as the worker counted it.

    ``created_at`` is when the request finished; None means "now" at recording time.
    ``api_key_id`` is the key the request was made with (None when auth is off).
    ``client_request_id`` is the ``x-request-id`` the client sent, if any: kept so a client
    can find its request, never used as the ledger's key (clients may reuse theirs).
    Invalid values raise :class:`ValueError` on construction.
    """

    request_id: str
    deployment: str
    endpoint: str
    status: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    tenant_id: int = DEFAULT_TENANT_ID
    queue_seconds: float | None = None
    ttft_seconds: float | None = None
    total_seconds: float | None = None
    cold_start: bool = False
    error: str | None = None
    created_at: datetime | None = None
    api_key_id: int | None = None
    client_request_id: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > REQUEST_ID_MAX_LEN:
            raise ValueError(f"request_id must be 1 to {REQUEST_ID_MAX_LEN} characters")
        if not self.deployment:
            raise ValueError("deployment must not be empty")
        if not self.endpoint:
            raise ValueError("endpoint must not be empty")
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})"
            )
        for name in ("queue_seconds", "ttft_seconds", "total_seconds"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value!r}")
        if self.created_at is not None and self.created_at.utcoffset() is None:
            raise ValueError("created_at must be timezone-aware")
        key = self.api_key_id
        if key is not None and (isinstance(key, bool) or not isinstance(key, int) or key < 1):
            raise ValueError(f"api_key_id must be an integer >= 1 or None, got {key!r}")
        client_id = self.client_request_id
        if client_id is not None and not _printable_ascii(client_id, REQUEST_ID_MAX_LEN):
            raise ValueError(
                f"client_request_id must be 1 to {REQUEST_ID_MAX_LEN} printable ASCII"
                f" characters or None, got {client_id!r}"
            )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Ledger:
    """Records usage into, and reads it back from, the ``usage_events`` table."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def record(self, rec: UsageRecord) -> bool:
        """Record one request's usage. True if it was new, False if ``request_id`` was seen."""
        return self.record_many([rec]) == 1

    def record_many(self, recs: Iterable[UsageRecord]) -> int:
        """Record a batch in one transaction; returns how many were new (replays are skipped)."""
        now = utcnow()
        rows = [_to_row(rec, now) for rec in recs]
        inserted = 0
        with self.db.engine.begin() as conn:
            for i in range(0, len(rows), _BATCH):
                # Both dialects' insert() offer ON CONFLICT; the generic one does not.
                stmt = (
                    self.db.insert(UsageEvent)
                    .values(rows[i : i + _BATCH])
                    .on_conflict_do_nothing(index_elements=[UsageEvent.request_id])
                    .returning(UsageEvent.id)
                )
                inserted += len(conn.execute(stmt).all())
        return inserted

    def events(self, deployment: str | None = None, limit: int = 100) -> list[UsageRecord]:
        """The latest ``limit`` events, newest first, optionally of one deployment."""
        stmt = select(UsageEvent).order_by(UsageEvent.created_at.desc(), UsageEvent.id.desc())
        if deployment is not None:
            stmt = stmt.where(UsageEvent.deployment == deployment)
        with self.db.session() as session:
            return [_from_row(ev) for ev in session.scalars(stmt.limit(limit))]


_FIELDS = (
    "request_id",
    "tenant_id",
    "api_key_id",
    "deployment",
    "endpoint",
    "status",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "queue_seconds",
    "ttft_seconds",
    "total_seconds",
    "cold_start",
    "error",
    "client_request_id",
)


def _printable_ascii(value: object, max_len: int) -> bool:
    return (
        isinstance(value, str)
        and 1 <= len(value) <= max_len
        and all(" " <= ch <= "~" for ch in value)
    )


def _to_row(rec: UsageRecord, now: datetime) -> dict[str, Any]:
    row = {name: getattr(rec, name) for name in _FIELDS}
    row["created_at"] = rec.created_at or now
    return row


def _from_row(ev: UsageEvent) -> UsageRecord:
    return UsageRecord(**{name: getattr(ev, name) for name in _FIELDS}, created_at=ev.created_at)
