"""Deployments as stored: a name, the snapshot it serves, how replicas load it and its
scaling policy."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hotpool.billing.db import Database
from hotpool.billing.models import (
    DEFAULT_TENANT_ID,
    DTYPES,
    QUANTIZATIONS,
    Deployment,
    DeploymentVersion,
    utcnow,
)
from hotpool.billing.versions import VersionRecord, changes_json, version_record

NAME_MAX_LEN = 128
MIN_MAX_MODEL_LEN = 16
MIN_KV_CACHE_BYTES = 1 << 20
# 16 TiB: above any one machine's memory. A value past it (up to 2**63 fit the column) made
# the worker's allocation overflow instead of a clear refusal.
MAX_KV_CACHE_BYTES = 1 << 44
# What a replica loads: a change to any of these needs new replicas (a new generation).
REPLICA_FIELDS = (
    "snapshot_uri", "dtype", "quantization", "speculative", "max_model_len", "kv_cache_bytes",
)  # fmt: skip
# Fields the store owns or that identify the deployment: update() cannot change them.
FIXED_FIELDS = frozenset(
    {"name", "tenant_id", "created_at", "generation", "canary_version", "canary_percent",
     "previous_version"}
)  # fmt: skip


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


class VersionNotFound(Exception):
    """The deployment has no such version."""

    def __init__(self, name: str, version: int) -> None:
        super().__init__(f"deployment {name!r} has no version {version}")
        self.name = name
        self.version = version


class VersionConflict(Exception):
    """A version change that cannot apply to the deployment as it is (its message says why)."""


@dataclass(frozen=True)
class DeploymentSpec:
    """What a user asks for when deploying a model; invalid values raise ValueError.

    The optional settings are None for "the default": the server's for ``max_queue``
    (requests that may wait for a replica), ``queue_timeout_s`` and ``kv_cache_bytes`` (the
    KV cache budget of each replica); the snapshot's for ``dtype`` and ``max_model_len``
    (the context length cap). ``quantization`` is how replicas hold the linear weights:
    ``none`` (in the activation dtype), ``int8`` (per-channel weight-only int8, made at
    load) or ``gguf`` (the GGUF blocks a snapshot converted from a GGUF keeps).
    ``speculative`` is the speculative decoding policy as compact JSON (the API's object,
    checked by the control plane: ``method``, ``num_tokens``, ``max_batch``, ...), or None
    for none; text, not a dict, so that a spec stays hashable and compares by value.

    ``created_at`` and ``generation`` are set by the store and ignored when a spec is
    written. ``generation`` is the number of the *stable* version: every change of what
    replicas run (see :func:`runs_differently`) creates a new numbered version
    (:class:`~hotpool.billing.versions.VersionRecord`). While a canary runs,
    ``canary_version`` takes ``canary_percent`` percent of the requests;
    ``previous_version`` is the stable version a rollback returns to.
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
    quantization: str = "none"
    speculative: str | None = None
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    default_max_tokens: int | None = None
    max_tokens_limit: int | None = None
    generation: int = 1
    canary_version: int | None = None
    canary_percent: float | None = None
    previous_version: int | None = None

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
            ("default_max_tokens", 1),
            ("max_tokens_limit", 1),
        ):
            value = getattr(self, name)
            if value is not None and not _int_at_least(value, minimum):
                raise ValueError(f"{name} must be an integer >= {minimum} or None, got {value!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes > MAX_KV_CACHE_BYTES:
            raise ValueError(
                f"kv_cache_bytes must be at most {MAX_KV_CACHE_BYTES} (16 TiB), "
                f"got {self.kv_cache_bytes}"
            )
        default, limit = self.default_max_tokens, self.max_tokens_limit
        if default is not None and limit is not None and default > limit:
            raise ValueError(
                f"default_max_tokens ({default}) must be at most max_tokens_limit ({limit})"
            )
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
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.speculative is not None and not _json_object_text(self.speculative):
            raise ValueError(
                f"speculative must be a JSON object's text or None, got {self.speculative!r}"
            )
        if not _int_at_least(self.generation, 1):
            raise ValueError(f"generation must be an integer >= 1, got {self.generation!r}")
        if (self.canary_version is None) != (self.canary_percent is None):
            raise ValueError("canary_version and canary_percent go together")
        if self.canary_version is not None:
            check_percent(self.canary_percent)
            if not _int_at_least(self.canary_version, 1):
                raise ValueError(f"canary_version must be an integer >= 1, got "
                                 f"{self.canary_version!r}")  # fmt: skip
            if self.canary_version == self.generation:
                raise ValueError(f"version {self.generation} is already the stable version")

    def at_version(self, v: VersionRecord) -> DeploymentSpec:
        """This deployment as replicas of version ``v`` run it: ``v``'s snapshot and engine
        options, with ``generation`` set to ``v``'s number (replicas carry it)."""
        return replace(
            self,
            snapshot_uri=v.snapshot_uri,
            dtype=v.dtype,
            quantization=v.quantization,
            speculative=v.speculative,
            max_model_len=v.max_model_len,
            kv_cache_bytes=v.kv_cache_bytes,
            generation=v.version,
            canary_version=None,
            canary_percent=None,
        )


def check_percent(percent: object) -> float:
    """``percent`` as a float if it is a number from 0 to 100, else ValueError."""
    if (
        isinstance(percent, bool)
        or not isinstance(percent, int | float)
        or not math.isfinite(percent)
        or not 0 <= percent <= 100
    ):
        raise ValueError(f"percent must be a number from 0 to 100, got {percent!r}")
    return float(percent)


def _json_object_text(value: object) -> bool:
    try:
        return isinstance(value, str) and isinstance(json.loads(value), dict)
    except ValueError:
        return False


def runs_differently(old: DeploymentSpec, new: DeploymentSpec) -> bool:
    """True when replicas loaded for ``old`` cannot serve ``new`` (its snapshot, dtype,
    quantization, speculation, context length or KV cache budget differ); scaling and
    queueing settings do not count."""
    return any(getattr(old, name) != getattr(new, name) for name in REPLICA_FIELDS)


UPDATABLE_FIELDS = tuple(f.name for f in fields(DeploymentSpec) if f.name not in FIXED_FIELDS)


class DeploymentStore:
    """Create, read, update and delete deployments in the database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, spec: DeploymentSpec, created_by: str | None = None) -> DeploymentSpec:
        """Store a new deployment (its version 1); raises DeploymentExists if the name is
        taken."""
        row = Deployment(**_values(spec), generation=1)
        try:
            with self.db.session() as session, session.begin():
                session.add(row)
                session.flush()
                session.add(_version_row(row, 1, created_by, None))
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

    def update(self, name: str, /, created_by: str | None = None, **changes: Any) -> DeploymentSpec:
        """Change some settings of deployment ``name`` and return its new spec.

        ``changes`` are spec fields other than those in :data:`FIXED_FIELDS` (anything else
        raises TypeError); the result is validated as a whole (ValueError, nothing written).
        A change that :func:`runs_differently` creates a new version and makes it the stable
        one at once (the old stable becomes ``previous_version``). Raises DeploymentNotFound
        if there is no such deployment. Concurrent updates serialize: each applies its
        changes to the row as the previous one left it.
        """
        _check_updatable(changes)
        with self.db.session() as session, session.begin():
            row = self._read_for_update(session, name)
            old = _spec(row)
            new = replace(old, **changes)
            if runs_differently(old, new):
                version = self._next_version(session, row)
                session.add(_version_row(row, version, created_by, _diff(old, new), new))
                new = replace(new, generation=version, previous_version=old.generation)
                if new.canary_version is not None and new.canary_version == version:
                    new = replace(new, canary_version=None, canary_percent=None)
            self._write(row, new)
        return _spec(row)

    def add_canary(
        self,
        name: str,
        percent: float,
        created_by: str | None = None,
        **changes: Any,
    ) -> DeploymentSpec:
        """A new version from the stable one with ``changes`` (what replicas run only), sent
        ``percent`` percent of the requests; the stable version stays. VersionConflict if
        the changes run nothing different."""
        percent = check_percent(percent)
        unknown = sorted(set(changes) - set(REPLICA_FIELDS))
        if unknown:
            raise TypeError(f"a canary changes only {', '.join(REPLICA_FIELDS)}, not {unknown[0]}")
        with self.db.session() as session, session.begin():
            row = self._read_for_update(session, name)
            old = _spec(row)
            new = replace(old, **changes)
            if not runs_differently(old, new):
                raise VersionConflict(
                    "the canary would run what the stable version runs; change the snapshot"
                    " or an engine option"
                )
            version = self._next_version(session, row)
            session.add(_version_row(row, version, created_by, _diff(old, new), new))
            self._write(row, replace(old, canary_version=version, canary_percent=percent))
        return _spec(row)

    def set_canary(self, name: str, version: int | None, percent: float | None) -> DeploymentSpec:
        """Send ``percent`` percent of the requests to an existing ``version`` (None: end the
        canary, all traffic to the stable version). VersionNotFound, VersionConflict."""
        with self.db.session() as session, session.begin():
            row = self._read_for_update(session, name)
            old = _spec(row)
            if version is None:
                new = replace(old, canary_version=None, canary_percent=None)
            else:
                percent = check_percent(percent)
                if self._version(session, row, version) is None:
                    raise VersionNotFound(name, version)
                if version == old.generation:
                    raise VersionConflict(f"version {version} is the stable version already")
                new = replace(old, canary_version=version, canary_percent=percent)
            self._write(row, new)
        return _spec(row)

    def promote(self, name: str) -> DeploymentSpec:
        """Make the canary the stable version (the old stable becomes ``previous_version``).
        VersionConflict without a canary."""
        with self.db.session() as session, session.begin():
            row = self._read_for_update(session, name)
            old = _spec(row)
            if old.canary_version is None:
                raise VersionConflict(f"deployment {name!r} has no canary to promote")
            self._make_stable(session, row, old, old.canary_version)
        return _spec(row)

    def rollback(self, name: str) -> DeploymentSpec:
        """All traffic back to the previous stable version: during a canary, the stable
        version (the canary ends); otherwise ``previous_version`` becomes stable again.
        VersionConflict when there is nothing to return to."""
        with self.db.session() as session, session.begin():
            row = self._read_for_update(session, name)
            old = _spec(row)
            if old.canary_version is not None:
                self._write(row, replace(old, canary_version=None, canary_percent=None))
            elif old.previous_version is not None:
                self._make_stable(session, row, old, old.previous_version)
            else:
                raise VersionConflict(
                    f"deployment {name!r} has no canary and no previous version to roll back to"
                )
        return _spec(row)

    def versions(self, name: str) -> list[VersionRecord]:
        """Every version of deployment ``name``, oldest first; DeploymentNotFound."""
        with self.db.session() as session:
            row = session.scalar(select(Deployment).where(Deployment.name == name))
            if row is None:
                raise DeploymentNotFound(name)
            stmt = (
                select(DeploymentVersion)
                .where(DeploymentVersion.deployment_id == row.id)
                .order_by(DeploymentVersion.version)
            )
            return [version_record(name, v) for v in session.scalars(stmt)]

    def version(self, name: str, version: int) -> VersionRecord:
        """One version of deployment ``name``; DeploymentNotFound, VersionNotFound."""
        with self.db.session() as session:
            row = session.scalar(select(Deployment).where(Deployment.name == name))
            if row is None:
                raise DeploymentNotFound(name)
            found = self._version(session, row, version)
            if found is None:
                raise VersionNotFound(name, version)
            return version_record(name, found)

    def _make_stable(
        self, session: Session, row: Deployment, old: DeploymentSpec, version: int
    ) -> None:
        v = self._version(session, row, version)
        if v is None:
            raise VersionNotFound(old.name, version)
        new = replace(
            old.at_version(version_record(old.name, v)),
            previous_version=old.generation,
            canary_version=None,
            canary_percent=None,
        )
        self._write(row, new)

    def _write(self, row: Deployment, new: DeploymentSpec) -> None:
        for key, value in _values(new).items():
            setattr(row, key, value)
        row.generation = new.generation
        row.canary_version = new.canary_version
        row.canary_percent = new.canary_percent
        row.previous_version = new.previous_version
        row.updated_at = utcnow()

    def _next_version(self, session: Session, row: Deployment) -> int:
        # Under the row lock taken by _read_for_update: no other writer picks the same one.
        stmt = select(func.max(DeploymentVersion.version)).where(
            DeploymentVersion.deployment_id == row.id
        )
        return int(session.scalar(stmt) or 0) + 1

    def _version(self, session: Session, row: Deployment, version: int) -> DeploymentVersion | None:
        return session.scalar(
            select(DeploymentVersion).where(
                DeploymentVersion.deployment_id == row.id, DeploymentVersion.version == version
            )
        )

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

    def upsert(self, spec: DeploymentSpec, created_by: str | None = None) -> DeploymentSpec:
        """Create the deployment or replace its settings, keeping its ``created_at``.

        A replacement that :func:`runs_differently` creates a version, as update() does.
        """
        changes = {f: getattr(spec, f) for f in UPDATABLE_FIELDS}
        try:
            return self.update(spec.name, created_by=created_by, **changes)
        except DeploymentNotFound:
            pass
        try:
            return self.create(spec, created_by=created_by)
        except DeploymentExists:  # created meanwhile by someone else: replace its settings
            return self.update(spec.name, created_by=created_by, **changes)

    def delete(self, name: str) -> None:
        """Remove a deployment; raises DeploymentNotFound if there is none. Usage is kept."""
        with self.db.engine.begin() as conn:
            result = conn.execute(delete(Deployment).where(Deployment.name == name))
        if result.rowcount == 0:
            raise DeploymentNotFound(name)


def _check_updatable(changes: dict[str, Any]) -> None:
    unknown = sorted(set(changes) - set(UPDATABLE_FIELDS))
    if unknown:
        raise TypeError(
            f"cannot update {', '.join(map(repr, unknown))}; updatable fields:"
            f" {', '.join(UPDATABLE_FIELDS)}"
        )


def _diff(old: DeploymentSpec, new: DeploymentSpec) -> dict[str, list[Any]]:
    """What a new version changes: {field: [old, new]} over what replicas run."""
    return {
        f: [getattr(old, f), getattr(new, f)]
        for f in REPLICA_FIELDS
        if getattr(old, f) != getattr(new, f)
    }


def _version_row(
    row: Deployment,
    version: int,
    created_by: str | None,
    changes: dict[str, list[Any]] | None,
    spec: DeploymentSpec | None = None,
) -> DeploymentVersion:
    source: Any = spec if spec is not None else row
    return DeploymentVersion(
        deployment_id=row.id,
        version=version,
        snapshot_uri=source.snapshot_uri,
        dtype=source.dtype,
        quantization=source.quantization,
        speculative=source.speculative,
        max_model_len=source.max_model_len,
        kv_cache_bytes=source.kv_cache_bytes,
        created_by=created_by,
        changes=changes_json(changes),
    )


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
        "default_max_tokens": spec.default_max_tokens,
        "max_tokens_limit": spec.max_tokens_limit,
        "dtype": spec.dtype,
        "quantization": spec.quantization,
        "speculative": spec.speculative,
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
        quantization=row.quantization,
        speculative=row.speculative,
        max_model_len=row.max_model_len,
        kv_cache_bytes=row.kv_cache_bytes,
        default_max_tokens=row.default_max_tokens,
        max_tokens_limit=row.max_tokens_limit,
        generation=row.generation,
        canary_version=row.canary_version,
        canary_percent=row.canary_percent,
        previous_version=row.previous_version,
    )
