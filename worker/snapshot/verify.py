"""Read a snapshot from a store and check it against its manifest while bytes stream in."""

from __future__ import annotations

import hashlib
from pathlib import Path

from hotpool.worker.snapshot.errors import ObjectNotFoundError, SnapshotError
from hotpool.worker.snapshot.manifest import MANIFEST_NAME, ManifestFile
from hotpool.worker.snapshot.store import ObjectStore


def manifest_bytes_at(store: ObjectStore, prefix: str, uri: str) -> bytes:
    """The raw ``manifest.json`` of the snapshot at ``uri``; a clear error when there is none."""
    try:
        return store.get_bytes(prefix + MANIFEST_NAME)
    except ObjectNotFoundError:
        raise SnapshotError(f"no snapshot at {uri} ({MANIFEST_NAME} not found)") from None


def download_verified(store: ObjectStore, key: str, dest: Path, expected: ManifestFile) -> None:
    """Stream one object to ``dest``, hashing as it arrives; a mismatch is a SnapshotError."""
    hasher = hashlib.sha256()
    size = 0

    def on_chunk(chunk: bytes) -> None:
        nonlocal size
        size += len(chunk)
        if size > expected.size:
            raise SnapshotError(
                f"snapshot file {expected.path!r} is larger than the {expected.size} bytes "
                "its manifest says"
            )
        hasher.update(chunk)

    try:
        store.download(key, dest, on_chunk)
    except ObjectNotFoundError:
        raise SnapshotError(
            f"snapshot file {expected.path!r} is listed in the manifest but missing from the store"
        ) from None
    if size != expected.size:
        raise SnapshotError(
            f"snapshot file {expected.path!r} is {size} bytes, manifest says {expected.size}"
        )
    if hasher.hexdigest() != expected.sha256:
        raise SnapshotError(
            f"snapshot file {expected.path!r} failed verification: sha256 {hasher.hexdigest()} "
            f"!= manifest {expected.sha256}"
        )
