"""Snapshot names: what a bare name such as ``smollm2`` means, for the CLI and the API alike.

A snapshot is addressed by URI (``file:///abs/path``, ``s3://bucket/prefix``) or by a bare
name, which means the snapshot of that name in the local object store
(``HOTPOOL_OBJECT_STORE``'s ``snapshots/``, where ``hotpool models pull`` and
``hotpool snapshot push SRC NAME`` put it).
"""

from __future__ import annotations

import re
from pathlib import Path

# Parts of letters, digits, '.', '_', '-' (none a '.' or '..': the name must stay inside the
# local object store), separated by '/'.
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")


class SnapshotNameError(ValueError):
    """A value that is neither a URI nor a snapshot name."""


def is_bare_name(value: str) -> bool:
    """Whether ``value`` is to be read as a name in the local store (it is not a URI)."""
    return "://" not in value


def resolve_snapshot(value: str, snapshots_dir: Path) -> str:
    """A full URI as given; a bare name, the ``file://`` URI of that snapshot in the local
    object store whose snapshots live in ``snapshots_dir`` (``Settings.snapshots_dir``)."""
    if not is_bare_name(value):
        return value
    if not SNAPSHOT_NAME.fullmatch(value):
        shown = value if len(value) <= 200 else f"{value[:200]}... ({len(value)} characters)"
        raise SnapshotNameError(
            f"{shown!r} is neither a snapshot name (letters, digits, '.', '_' and '-', parts "
            "separated by '/') nor a URI such as file:///abs/path or s3://bucket/prefix"
        )
    return f"file://{snapshots_dir / value}"
