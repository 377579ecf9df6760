"""Deployment versions as read from the store: immutable, numbered, with who made each one,
when, and what it changed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hotpool.billing.models import DeploymentVersion


@dataclass(frozen=True)
class VersionRecord:
    """What replicas of one version run. ``changes`` is ``{field: [old, new]}`` against the
    stable version it was made from (None for a deployment's first version)."""

    deployment: str
    version: int
    snapshot_uri: str
    dtype: str | None = None
    quantization: str = "none"
    speculative: str | None = None  # the policy's JSON
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    created_at: datetime | None = None
    created_by: str | None = None
    changes: dict[str, list[Any]] | None = None


def changes_json(changes: dict[str, list[Any]] | None) -> str | None:
    return None if changes is None else json.dumps(changes, sort_keys=True)


def version_record(deployment: str, row: DeploymentVersion) -> VersionRecord:
    return VersionRecord(
        deployment=deployment,
        version=row.version,
        snapshot_uri=row.snapshot_uri,
        dtype=row.dtype,
        quantization=row.quantization,
        speculative=row.speculative,
        max_model_len=row.max_model_len,
        kv_cache_bytes=row.kv_cache_bytes,
        created_at=row.created_at,
        created_by=row.created_by,
        changes=None if row.changes is None else json.loads(row.changes),
    )
