"""The worker's local snapshot cache, keyed by manifest digest.

A cold start is "fetch, load, warm up"; this module makes the fetch free on a hit and safe on
a miss. Entries are installed with one ``rename`` of a fully verified folder, so a folder
named after a digest is always complete: a crash mid-download leaves only a ``.tmp-*``
folder, never a half snapshot that a later start would trust.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hotpool.worker.snapshot.errors import ObjectNotFoundError, SnapshotError
from hotpool.worker.snapshot.manifest import MANIFEST_NAME, Manifest, ManifestFile, read_manifest
from hotpool.worker.snapshot.store import ObjectStore, open_snapshot_uri

StoreOpener = Callable[[str], tuple[ObjectStore, str]]

TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class CachedSnapshot:
    """A verified local copy of a snapshot; ``path`` also holds its ``manifest.json``."""

    path: Path
    manifest: Manifest
    cache_hit: bool
    fetch_seconds: float


class SnapshotCache:
    """Fetches snapshots from object storage into ``root/<manifest digest>/``.

    One instance per worker process: fetches of one digest are single-flight within the
    instance (the second caller waits and gets a hit). Across processes the atomic rename
    decides who installs; the loser discards its copy. ``open_store`` turns a URI into
    ``(store, prefix)``; tests and S3 settings plug in here.
    """

    def __init__(self, root: Path, open_store: StoreOpener = open_snapshot_uri) -> None:
        self.root = root
        self._open_store = open_store
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def path_for(self, manifest: Manifest) -> Path:
        """Where the snapshot with this manifest lives once cached."""
        return self.root / manifest.digest

    def fetch(self, uri: str) -> CachedSnapshot:
        """Make the snapshot at ``uri`` available locally, downloading it only on a miss.

        Raises :class:`SnapshotError` when the URI has no snapshot or a file fails
        verification; in that case no folder named after the digest is created.
        """
        start = time.perf_counter()
        store, prefix = self._open_store(uri)
        try:
            raw = store.get_bytes(prefix + MANIFEST_NAME)
        except ObjectNotFoundError:
            raise SnapshotError(f"no snapshot at {uri} ({MANIFEST_NAME} not found)") from None
        manifest = read_manifest(raw)
        final = self.path_for(manifest)
        hit = True
        if not final.is_dir():
            with self._lock_for(manifest.digest):
                if not final.is_dir():
                    self._download(store, prefix, manifest, raw, final)
                    hit = False
        return CachedSnapshot(final, manifest, hit, time.perf_counter() - start)

    def _lock_for(self, digest: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(digest, threading.Lock())

    def _download(
        self, store: ObjectStore, prefix: str, manifest: Manifest, raw: bytes, final: Path
    ) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{manifest.digest}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            for f in manifest.files:
                _download_verified(store, prefix + f.path, tmp / f.path, f)
            (tmp / MANIFEST_NAME).write_bytes(raw)
            try:
                os.rename(tmp, final)
            except OSError:
                # Another process installed the same digest first; its copy is as good.
                if not final.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _download_verified(store: ObjectStore, key: str, dest: Path, expected: ManifestFile) -> None:
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
