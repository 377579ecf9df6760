"""Deployments as stored: a name, the snapshot it serves and its scaling policy."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from hotpool.billing.db import Database
from hotpool.billing.models import DEFAULT_TENANT_ID, Deployment, utcnow

NAME_MAX_LEN = 128


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

    ``created_at`` is set by the store; it is ignored when a spec is written.
    """

    name: str
    snapshot_uri: str
    min_replicas: int = 0
    max_replicas: int = 1
    target_concurrency: int = 8
    idle_timeout_s: float = 300.0
    tenant_id: int = DEFAULT_TENANT_ID
    created_at: datetime | None = None

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

    def upsert(self, spec: DeploymentSpec) -> DeploymentSpec:
        """Create the deployment or replace its settings, keeping its ``created_at``."""
        now = utcnow()
        values = _values(spec)
        stmt = self.db.insert(Deployment).values(**values, created_at=now, updated_at=now)
        stmt = stmt.on_conflict_do_update(
            index_elements=[Deployment.name], set_={**values, "updated_at": now}
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


def _values(spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "snapshot_uri": spec.snapshot_uri,
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas,
        "target_concurrency": spec.target_concurrency,
        "idle_timeout_s": float(spec.idle_timeout_s),
        "tenant_id": spec.tenant_id,
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
    )
