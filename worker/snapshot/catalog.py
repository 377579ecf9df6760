"""Look after snapshots already in a store: list them, read, verify and remove one."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.manifest import MANIFEST_NAME, Manifest, ManifestFile, read_manifest
from hotpool.worker.snapshot.store import open_snapshot_uri
from hotpool.worker.snapshot.verify import download_verified, manifest_bytes_at


@dataclass(frozen=True)
class SnapshotListing:
    """A snapshot found under a prefix; ``error`` says why its manifest could not be read."""

    uri: str
    manifest: Manifest | None
    error: str | None = None


def list_snapshots(uri_prefix: str) -> list[SnapshotListing]:
    """Every snapshot (a folder holding ``manifest.json``) at or below ``uri_prefix``."""
    store, prefix = open_snapshot_uri(uri_prefix)
    base = uri_prefix.rstrip("/")
    found = []
    for key in store.list(prefix):
        rel = key[len(prefix) :]
        if rel != MANIFEST_NAME and not rel.endswith("/" + MANIFEST_NAME):
            continue
        folder = rel[: -len(MANIFEST_NAME)].rstrip("/")
        uri = f"{base}/{folder}" if folder else base
        try:
            found.append(SnapshotListing(uri, read_manifest(store.get_bytes(key))))
        except SnapshotError as exc:
            found.append(SnapshotListing(uri, None, str(exc)))
    return found


def read_snapshot_manifest(uri: str) -> Manifest:
    """The manifest of the snapshot at ``uri``; a clear error when there is none."""
    store, prefix = open_snapshot_uri(uri)
    return read_manifest(manifest_bytes_at(store, prefix, uri))


def verify_snapshot(
    uri: str, on_file: Callable[[ManifestFile, str | None], None] | None = None
) -> tuple[Manifest, list[tuple[ManifestFile, str]]]:
    """Stream every file of the snapshot at ``uri`` and check its size and sha256.

    Returns the manifest and the files that failed, each with the reason; ``on_file`` hears
    about each file as it is checked (reason None when it is good). Files pass through a
    temporary folder one at a time, so this needs disk for the largest file only.
    """
    manifest = read_snapshot_manifest(uri)
    store, prefix = open_snapshot_uri(uri)
    bad = []
    with tempfile.TemporaryDirectory(prefix="hotpool-verify-") as tmp:
        for f in manifest.files:
            dest = Path(tmp) / "file"
            reason = None
            try:
                download_verified(store, prefix + f.path, dest, f)
            except SnapshotError as exc:
                reason = str(exc)
                bad.append((f, reason))
            finally:
                dest.unlink(missing_ok=True)
            if on_file is not None:
                on_file(f, reason)
    return manifest, bad


def remove_snapshot(uri: str) -> Manifest:
    """Delete the snapshot at ``uri``: its manifest first, so no reader starts on a snapshot
    losing its files, then the files it lists. Other objects under ``uri`` stay."""
    manifest = read_snapshot_manifest(uri)
    store, prefix = open_snapshot_uri(uri)
    store.delete([prefix + MANIFEST_NAME])
    store.delete(prefix + f.path for f in manifest.files)
    return manifest
