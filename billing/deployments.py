"""Deployments as stored: a name, the snapshot it serves, how replicas load it and its
scaling policy."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any

from sqlalchemy import case, delete, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hotpool.billing.db import Database
from hotpool.billing.models import DEFAULT_TENANT_ID, DTYPES, Deployment, utcnow

NAME_MAX_LEN = 128
MIN_MAX_MODEL_LEN = 16
MIN_KV_CACHE_BYTES = 1 << 20
# What a replica loads: a change to any of these needs new replicas (a new generation).
REPLICA_FIELDS = ("snapshot_uri", "dtype", "max_model_len", "kv_cache_bytes")
# Fields the store owns or that identify the deployment: update() cannot change them.
FIXED_FIELDS = frozenset({"name", "tenant_id", "created_at", "generation"})


class DeploymentExists(Exception):
    """A deployment with this name already exists."""

    def __init__(self, name: str) -> None:
        super().__init__(f"deployment {name!r} already exists")
        self.name = name


class DeploymentNotFound(Exception):
    """No deployment has this name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"deployment {name!r} not found")
        self.name = name


@dataclass(frozen=True)
class DeploymentSpec:
    """What a user asks for when deploying a model; invalid values raise ValueError.

    The optional settings are None for "the default": the server's for ``max_queue``
    (requests that may wait for a replica), ``queue_timeout_s`` and ``kv_cache_bytes`` (the
    KV cache budget of each replica); the snapshot's for ``dtype`` and ``max_model_len``
    (the context length cap).

    ``created_at`` and ``generation`` are set by the store and ignored when a spec is
    written; ``generation`` starts at 1 and goes up by one each time an update changes what
    replicas run (see :func:`runs_differently`).
    """

    name: str
    snapshot_uri: str
    min_replicas: int = 0
    max_replicas: int = 1
    target_concurrency: int = 8
    idle_timeout_s: float = 300.0
    tenant_id: int = DEFAULT_TENANT_ID
    created_at: datetime | None = None
    max_queue: int | None = None
    queue_timeout_s: float | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    generation: int = 1

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > NAME_MAX_LEN:
            raise ValueError(f"name must be 1 to {NAME_MAX_LEN} characters")
        if not self.snapshot_uri:
            raise ValueError("snapshot_uri must not be empty")
        for name in ("min_replicas", "max_replicas", "target_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(
                f"max_replicas must be >= 1 and >= min_replicas ({self.min_replicas}),"
                f" got {self.max_replicas}"
            )
        if self.target_concurrency < 1:
            raise ValueError(f"target_concurrency must be >= 1, got {self.target_concurrency}")
        if not (math.isfinite(self.idle_timeout_s) and self.idle_timeout_s >= 0):
            raise ValueError(
                f"idle_timeout_s must be a finite number >= 0, got {self.idle_timeout_s}"
            )
        for name, minimum in (
            ("max_queue", 1),
            ("max_model_len", MIN_MAX_MODEL_LEN),
            ("kv_cache_bytes", MIN_KV_CACHE_BYTES),
        ):
            value = getattr(self, name)
            if value is not None and not _int_at_least(value, minimum):
                raise ValueError(f"{name} must be an integer >= {minimum} or None, got {value!r}")
        timeout = self.queue_timeout_s
        if timeout is not None and not (
            isinstance(timeout, int | float)
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
            and timeout > 0
        ):
            raise ValueError(
                f"queue_timeout_s must be a finite number > 0 or None, got {timeout!r}"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(DTYPES)} or None, got {self.dtype!r}"
            )
        if not _int_at_least(self.generation, 1):
            raise ValueError(f"generation must be an integer >= 1, got {self.generation!r}")


def runs_differently(old: DeploymentSpec, new: DeploymentSpec) -> bool:
    """True when replicas loaded for ``old`` cannot serve ``new`` (its snapshot, dtype,
    context length or KV cache budget differ); scaling and queueing settings do not count."""
    return any(getattr(old, name) != getattr(new, name) for name in REPLICA_FIELDS)


UPDATABLE_FIELDS = tuple(f.name for f in fields(DeploymentSpec) if f.name not in FIXED_FIELDS)


class DeploymentStore:
    """Create, read, update and delete deployments in the database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, spec: DeploymentSpec) -> DeploymentSpec:
        """Store a new deployment; raises DeploymentExists if the name is taken."""
        row = Deployment(**_values(spec))
        try:
            with self.db.session() as session, session.begin():
                session.add(row)
        except IntegrityError as exc:
            # The unique name decides, so two concurrent creates cannot both succeed.
            if self.get(spec.name) is not None:
                raise DeploymentExists(spec.name) from exc
            raise
        return _spec(row)

    def get(self, name: str) -> DeploymentSpec | None:
        with self.db.session() as session:
            row = session.scalar(select(Deployment).where(Deployment.name == name))
            return None if row is None else _spec(row)

    def list(self) -> list[DeploymentSpec]:
        """Every deployment, by name."""
        stmt = select(Deployment).order_by(Deployment.name)
        with self.db.session() as session:
            return [_spec(row) for row in session.scalars(stmt)]

    def update(self, name: str, /, **changes: Any) -> DeploymentSpec:
        """Change some settings of deployment ``name`` and return its new spec.

        ``changes`` are spec fields other than those in :data:`FIXED_FIELDS` (anything else
        raises TypeError); the result is validated as a whole (ValueError, nothing written).
        The generation goes up by one when the change :func:`runs_differently`. Raises
        DeploymentNotFound if there is no such deployment. Concurrent updates serialize: each
        applies its changes to the row as the previous one left it.
        """
        unknown = sorted(set(changes) - set(UPDATABLE_FIELDS))
        if unknown:
            raise TypeError(
                f"cannot update {', '.join(map(repr, unknown))}; updatable fields:"
                f" {', '.join(UPDATABLE_FIELDS)}"
            )
        with self.db.session() as session, session.begin():
            row = self._read_for_update(session, name)
            old = _spec(row)
            new = replace(old, **changes)
            if runs_differently(old, new):
                new = replace(new, generation=old.generation + 1)
            for key, value in _values(new).items():
                setattr(row, key, value)
            row.generation = new.generation
            row.updated_at = utcnow()
        return _spec(row)

    def _read_for_update(self, session: Session, name: str) -> Deployment:
        """The row of ``name``, locked against other writers until the transaction ends."""
        if self.db.is_sqlite:
            # pysqlite only opens a transaction at the first write, so a read before it would
            # not be protected: take SQLite's write lock (it has no row locks) before reading.
            # The busy timeout makes a concurrent update wait for it.
            session.connection().exec_driver_sql("BEGIN IMMEDIATE")
        stmt = select(Deployment).where(Deployment.name == name).with_for_update()
        row = session.scalar(stmt)
        if row is None:
            raise DeploymentNotFound(name)
        return row

    def upsert(self, spec: DeploymentSpec) -> DeploymentSpec:
        """Create the deployment or replace its settings, keeping its ``created_at``.

        A replacement that :func:`runs_differently` bumps the generation, as update() does.
        """
        now = utcnow()
        values = _values(spec)
        stmt = self.db.insert(Deployment).values(**values, created_at=now, updated_at=now)
        changed = or_(
            *(getattr(Deployment, f).is_distinct_from(stmt.excluded[f]) for f in REPLICA_FIELDS)
        )
        generation = case((changed, Deployment.generation + 1), else_=Deployment.generation)
        stmt = stmt.on_conflict_do_update(
            index_elements=[Deployment.name],
            set_={**values, "generation": generation, "updated_at": now},
        ).returning(Deployment)
        with self.db.session() as session, session.begin():
            row = session.scalars(stmt).one()
            return _spec(row)

    def delete(self, name: str) -> None:
        """Remove a deployment; raises DeploymentNotFound if there is none. Usage is kept."""
        with self.db.engine.begin() as conn:
            result = conn.execute(delete(Deployment).where(Deployment.name == name))
        if result.rowcount == 0:
            raise DeploymentNotFound(name)


def _int_at_least(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _values(spec: DeploymentSpec) -> dict[str, Any]:
    """The columns a spec writes (not ``created_at`` nor ``generation``: the store's)."""
    timeout = spec.queue_timeout_s
    return {
        "name": spec.name,
        "snapshot_uri": spec.snapshot_uri,
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas,
        "target_concurrency": spec.target_concurrency,
        "idle_timeout_s": float(spec.idle_timeout_s),
        "tenant_id": spec.tenant_id,
        "max_queue": spec.max_queue,
        "queue_timeout_s": None if timeout is None else float(timeout),
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        "kv_cache_bytes": spec.kv_cache_bytes,
    }


def _spec(row: Deployment) -> DeploymentSpec:
    return DeploymentSpec(
        name=row.name,
        snapshot_uri=row.snapshot_uri,
        min_replicas=row.min_replicas,
        max_replicas=row.max_replicas,
        target_concurrency=row.target_concurrency,
        idle_timeout_s=float(row.idle_timeout_s),
        tenant_id=row.tenant_id,
        created_at=row.created_at,
        max_queue=row.max_queue,
        queue_timeout_s=row.queue_timeout_s,
        dtype=row.dtype,
        max_model_len=row.max_model_len,
        kv_cache_bytes=row.kv_cache_bytes,
        generation=row.generation,
    )
