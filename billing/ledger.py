"""The usage ledger: one append-only row per request, recorded exactly once.

The control plane records a :class:`UsageRecord` for every request whatever its outcome.
Delivery may repeat (retries, a replayed spool), so recording is idempotent by
``request_id``: a replay is a no-op, done in one ``INSERT ... ON CONFLICT DO NOTHING`` so two
writers racing on the same id cannot both insert it.

Each event's cost is computed as it is recorded, with the price in force at its
``created_at`` (:mod:`hotpool.billing.prices`), and never changes afterwards. A wrong count
is fixed by :meth:`Ledger.correct`, which appends a correction row rather than editing one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, func, or_, select

from hotpool.billing.db import Database
from hotpool.billing.models import DEFAULT_TENANT_ID, STATUSES, UsageEvent, utcnow
from hotpool.billing.prices import PriceBook

REQUEST_ID_MAX_LEN = 64
REASON_MAX_LEN = 1000


class EventNotFound(KeyError):
    """No usage event has this request id."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.request_id = request_id

    def __str__(self) -> str:
        return f"no usage event with request_id {self.request_id!r}"


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
    version: int | None = None  # the deployment version that served it

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > REQUEST_ID_MAX_LEN:
            raise ValueError(f"request_id must be 1 to {REQUEST_ID_MAX_LEN} characters")
        if not self.deployment:
            raise ValueError("deployment must not be empty")
        if not self.endpoint:
            raise ValueError("endpoint must not be empty")
        if self.version is not None and (
            isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1
        ):
            raise ValueError(f"version must be an integer >= 1 or None, got {self.version!r}")
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")
        _check_counts(self.prompt_tokens, self.cached_tokens, self.completion_tokens)
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


@dataclass(frozen=True, kw_only=True)
class LedgerEvent(UsageRecord):
    """A usage event as stored: its record, and what the ledger added to it.

    ``cost_micros`` is in integer micro-units of ``currency`` (both None: no price was in
    force). A correction row has ``corrects_id`` (the ``id`` of the event it corrects) and a
    ``reason``; its token counts and cost are deltas and may be negative, which is why the
    checks of :class:`UsageRecord` do not apply to it.
    """

    id: int
    cost_micros: int | None = None
    currency: str | None = None
    corrects_id: int | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.corrects_id is None:
            super().__post_init__()

    @property
    def is_correction(self) -> bool:
        return self.corrects_id is not None

    @property
    def record(self) -> UsageRecord:
        """The :class:`UsageRecord` part alone, as it was recorded (ValueError for a
        correction row: its deltas are no usage of their own)."""
        return UsageRecord(**{f.name: getattr(self, f.name) for f in fields(UsageRecord)})


class Ledger:
    """Records usage into, and reads it back from, the ``usage_events`` table."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def record(self, rec: UsageRecord) -> bool:
        """Record one request's usage. True if it was new, False if ``request_id`` was seen."""
        return self.record_many([rec]) == 1

    def record_many(self, recs: Iterable[UsageRecord]) -> int:
        """Record a batch in one transaction; returns how many were new (replays are skipped).

        Each new event is priced at its ``created_at``; the prices of the batch's
        deployments are read once, in the same transaction.
        """
        recs = list(recs)
        if not recs:
            return 0
        now = utcnow()
        with self.db.engine.begin() as conn:
            book = PriceBook.load(conn, {rec.deployment for rec in recs})
            rows = [_to_row(rec, now, book) for rec in recs]
            # Both dialects' insert() offer ON CONFLICT; the generic one does not. Executed
            # with a list of rows, the one compiled (and cached) statement is sent as
            # multi-row INSERTs (SQLAlchemy's "insertmanyvalues"), and RETURNING yields one
            # id per row that was new.
            stmt = (
                self.db.insert(UsageEvent)
                .on_conflict_do_nothing(index_elements=[UsageEvent.request_id])
                .returning(UsageEvent.id)
            )
            inserted = len(conn.execute(stmt, rows).all())
        return inserted

    def correct(
        self,
        request_id: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        reason: str,
    ) -> LedgerEvent | None:
        """Set what request ``request_id`` should have counted, by appending a correction.

        The counts given are the request's true totals. The correction row holds the
        difference from what the ledger holds for the request so far (the original and any
        earlier corrections), so sums over the rows give the corrected totals; its cost is
        the corrected totals' cost at the price in force at the original's ``created_at``,
        less the cost already recorded (None if no price is in force then). The row takes the
        original's tenant, key, deployment, status and ``created_at``, so it lands in the
        same usage bucket; its ``request_id`` is ``corr:<original id>:<n>``.

        Returns the correction, or None when the totals are already right (nothing is
        written, so a repeated correction is harmless). Raises EventNotFound for an unknown
        ``request_id``, ValueError for invalid counts, an empty reason, or a ``request_id``
        that is itself a correction. Concurrent corrections of one request serialize.
        """
        _check_counts(prompt_tokens, cached_tokens, completion_tokens)
        if not isinstance(reason, str) or not 1 <= len(reason.strip()) <= REASON_MAX_LEN:
            raise ValueError(f"reason must be 1 to {REASON_MAX_LEN} characters")
        with self.db.engine.begin() as conn:
            original = self._lock_event(conn, request_id)
            if original.corrects_id is not None:
                raise ValueError(
                    f"{request_id!r} is a correction; correct the original event instead"
                )
            rows = or_(UsageEvent.id == original.id, UsageEvent.corrects_id == original.id)
            count, prompt, cached, completion, cost = conn.execute(
                select(
                    func.count(),
                    func.sum(UsageEvent.prompt_tokens),
                    func.sum(UsageEvent.cached_tokens),
                    func.sum(UsageEvent.completion_tokens),
                    func.sum(UsageEvent.cost_micros),
                ).where(rows)
            ).one()
            delta = (
                prompt_tokens - int(prompt),
                cached_tokens - int(cached),
                completion_tokens - int(completion),
            )
            price = PriceBook.load(conn, [original.deployment]).in_force(
                original.deployment, original.created_at
            )
            new_cost = (
                None
                if price is None
                else price.cost_micros(prompt_tokens, cached_tokens, completion_tokens)
            )
            recorded_cost = None if cost is None else int(cost)
            if delta == (0, 0, 0) and new_cost == recorded_cost:
                return None
            row = {
                **{name: getattr(original, name) for name in _FIELDS},
                "request_id": f"corr:{original.id}:{count}",
                "prompt_tokens": delta[0],
                "cached_tokens": delta[1],
                "completion_tokens": delta[2],
                "queue_seconds": None,
                "ttft_seconds": None,
                "total_seconds": None,
                "cold_start": False,
                "error": None,
                "created_at": original.created_at,
                "cost_micros": None if new_cost is None else new_cost - (recorded_cost or 0),
                "currency": None if price is None else price.currency,
                "corrects_id": original.id,
                "reason": reason.strip(),
            }
            stmt = self.db.insert(UsageEvent).values(row).returning(UsageEvent.id)
            new_id = conn.execute(stmt).scalar_one()
        return _event({**row, "id": new_id})

    def _lock_event(self, conn: Connection, request_id: str) -> Any:
        """The row of ``request_id``, locked against other correctors until commit."""
        if self.db.is_sqlite:
            # SQLite has no row locks; take its write lock before reading (see deployments).
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        stmt = select(UsageEvent.__table__).where(UsageEvent.request_id == request_id)
        row = conn.execute(stmt.with_for_update()).first()
        if row is None:
            raise EventNotFound(request_id)
        return row

    def events(self, deployment: str | None = None, limit: int = 100) -> list[LedgerEvent]:
        """The latest ``limit`` events (corrections included), newest first, optionally of
        one deployment."""
        table = UsageEvent.__table__
        stmt = select(table).order_by(UsageEvent.created_at.desc(), UsageEvent.id.desc())
        if deployment is not None:
            stmt = stmt.where(UsageEvent.deployment == deployment)
        with self.db.engine.connect() as conn:
            return [_event(row._mapping) for row in conn.execute(stmt.limit(limit))]


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
    "version",
)


def _printable_ascii(value: object, max_len: int) -> bool:
    return (
        isinstance(value, str)
        and 1 <= len(value) <= max_len
        and all(" " <= ch <= "~" for ch in value)
    )


def _check_counts(prompt: int, cached: int, completion: int) -> None:
    for name, value in (
        ("prompt_tokens", prompt),
        ("completion_tokens", completion),
        ("cached_tokens", cached),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if cached > prompt:
        raise ValueError(f"cached_tokens ({cached}) exceeds prompt_tokens ({prompt})")


def _to_row(rec: UsageRecord, now: datetime, prices: PriceBook) -> dict[str, Any]:
    row = {name: getattr(rec, name) for name in _FIELDS}
    row["created_at"] = created_at = rec.created_at or now
    price = prices.in_force(rec.deployment, created_at)
    if price is None:
        row["cost_micros"] = row["currency"] = None
    else:
        row["cost_micros"] = price.cost_micros(
            rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens
        )
        row["currency"] = price.currency
    return row


_EXTRA = ("id", "created_at", "cost_micros", "currency", "corrects_id", "reason")


def _event(row: Mapping[str, Any]) -> LedgerEvent:
    return LedgerEvent(**{name: row[name] for name in (*_FIELDS, *_EXTRA)})
