"""The worker's local snapshot cache, keyed by manifest digest.

A cold start is "fetch, load, warm up"; this module makes the fetch free on a hit and safe on
a miss. Entries are installed with one ``rename`` of a fully verified folder, so a folder
named after a digest is always complete: a crash mid-download leaves only a ``.tmp-*``
folder, never a half snapshot that a later start would trust, and the next cache over the
folder deletes it.

Several worker processes (one per GPU) may share one cache folder. Per digest, two lock files
in ``.locks/`` coordinate them: ``<digest>.fetch`` (exclusive) makes a download single-flight
across processes, and ``<digest>.use`` (shared while a snapshot is pinned or being fetched)
keeps eviction away from snapshots in use. Eviction is least-recently-used under a byte
budget; the folder's mtime records the last use, so the order survives restarts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hotpool.worker.snapshot import locks
from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.manifest import MANIFEST_NAME, Manifest, read_manifest
from hotpool.worker.snapshot.store import ObjectStore, open_snapshot_uri
from hotpool.worker.snapshot.verify import download_verified, manifest_bytes_at

StoreOpener = Callable[[str], tuple[ObjectStore, str]]

TMP_PREFIX = ".tmp-"
LOCKS_DIR = ".locks"
_DIGEST = re.compile(r"[0-9a-f]{64}")

log = logging.getLogger("hotpool.worker.snapshot")


@dataclass(frozen=True)
class CachedSnapshot:
    """A verified local copy of a snapshot; ``path`` also holds its ``manifest.json``."""

    path: Path
    manifest: Manifest
    cache_hit: bool
    fetch_seconds: float


@dataclass(frozen=True)
class CacheEntry:
    """One installed snapshot: its size and when it was last used (seconds since the epoch)."""

    digest: str
    path: Path
    size: int
    last_used: float


def own_bytes(folder: Path) -> int:
    """The disk a cached snapshot takes for itself: its files that are no other file's
    links (a file:// snapshot's are the store's, linked: they cost nothing more)."""
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):  # evicted meanwhile
            st = path.stat()
            if path.is_file() and st.st_nlink == 1:
                total += st.st_size
    return total


@dataclass
class _Pin:
    count: int
    fd: int  # holds the shared lock on <digest>.use


class SnapshotCache:
    """Fetches snapshots from object storage into ``root/<manifest digest>/``.

    Fetches of one digest are single-flight: threads of one instance wait on a lock, other
    processes on the digest's lock file, and all but the first get a hit. ``max_bytes``
    (None: unbounded) is the budget that least-recently-used, unpinned snapshots are evicted
    to stay under; a snapshot larger than the whole budget is still fetched. The worker pins
    the snapshot it has loaded (``fetch(uri, pin=True)`` ... ``unpin(digest)``).
    ``open_store`` turns a URI into ``(store, prefix)``; tests plug in here.
    """

    def __init__(
        self,
        root: Path,
        open_store: StoreOpener = open_snapshot_uri,
        max_bytes: int | None = None,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._open_store = open_store
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()  # guards _locks and _pins
        self._pins: dict[str, _Pin] = {}
        self._evicting = threading.Lock()
        self._last_stamp = 0
        self.remove_stale_tmp()

    def path_for(self, manifest: Manifest) -> Path:
        """Where the snapshot with this manifest lives once cached."""
        return self.root / manifest.digest

    def fetch(self, uri: str, pin: bool = False) -> CachedSnapshot:
        """Make the snapshot at ``uri`` available locally, downloading it only on a miss.

        With ``pin`` the snapshot stays pinned (never evicted) until :meth:`unpin`. Raises
        :class:`SnapshotError` when the URI has no snapshot or a file fails verification; in
        that case no folder named after the digest is created.
        """
        start = time.perf_counter()
        store, prefix = self._open_store(uri)
        raw = manifest_bytes_at(store, prefix, uri)
        manifest = read_manifest(raw)
        final = self.path_for(manifest)
        self.pin(manifest.digest)  # from here on no eviction can remove it under us
        try:
            hit = final.is_dir() or self._fetch_once(store, prefix, manifest, raw, final)
            self._touch(final)
            if not hit:
                self.evict()
        except BaseException:
            self.unpin(manifest.digest)
            raise
        if not pin:
            self.unpin(manifest.digest)
        return CachedSnapshot(final, manifest, hit, time.perf_counter() - start)

    def manifest(self, uri: str) -> Manifest:
        """The manifest the store holds at ``uri`` now (one small read, no download)."""
        store, prefix = self._open_store(uri)
        return read_manifest(manifest_bytes_at(store, prefix, uri))

    @contextlib.contextmanager
    def use(self, uri: str) -> Iterator[CachedSnapshot]:
        """``with cache.use(uri) as snap:`` -- fetched and pinned for the block."""
        snap = self.fetch(uri, pin=True)
        try:
            yield snap
        finally:
            self.unpin(snap.manifest.digest)

    def pin(self, digest: str) -> None:
        """Keep ``digest`` from eviction (by any process) until a matching :meth:`unpin`."""
        if not _DIGEST.fullmatch(digest):
            raise ValueError(f"{digest!r} is not a snapshot digest (64 hex digits)")
        with self._guard:
            held = self._pins.get(digest)
            if held is not None:
                held.count += 1
                return
            fd = locks.acquire(self._lock_path(digest, "use"), locks.SHARED)
            self._pins[digest] = _Pin(1, fd)

    def unpin(self, digest: str) -> None:
        """Undo one :meth:`pin`; the snapshot counts as used now."""
        with self._guard:
            held = self._pins.get(digest)
            if held is None:
                raise ValueError(f"snapshot {digest} is not pinned")
            held.count -= 1
            if held.count == 0:
                del self._pins[digest]
                os.close(held.fd)
        with contextlib.suppress(FileNotFoundError):
            self._touch(self.root / digest)

    def is_pinned(self, digest: str) -> bool:
        with self._guard:
            return digest in self._pins

    def entries(self) -> list[CacheEntry]:
        """Installed snapshots, least recently used first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            if not _DIGEST.fullmatch(path.name):
                continue
            try:
                size = read_manifest(path / MANIFEST_NAME).total_bytes
                found.append(CacheEntry(path.name, path, size, path.stat().st_mtime_ns / 1e9))
            except (OSError, SnapshotError):
                continue  # evicted meanwhile by another process
        return sorted(found, key=lambda e: (e.last_used, e.digest))

    def evict(self, reserve: int = 0) -> list[str]:
        """Evict least-recently-used unpinned snapshots until ``reserve`` more bytes fit in
        the budget; returns the evicted digests. A no-op without ``max_bytes``."""
        if self.max_bytes is None:
            return []
        with self._evicting:
            entries = self.entries()
            used = sum(e.size for e in entries)
            evicted = []
            for entry in entries:
                if used + reserve <= self.max_bytes:
                    break
                if self._try_evict(entry.digest):
                    used -= entry.size
                    evicted.append(entry.digest)
            if used > self.max_bytes:
                log.warning(
                    "snapshot cache %s holds %d bytes in use, over its %d-byte budget",
                    self.root,
                    used,
                    self.max_bytes,
                )
            return evicted

    def remove_stale_tmp(self) -> list[str]:
        """Delete ``.tmp-*`` folders no live fetch is writing: leftovers of a crashed process
        (its lock died with it) or of an interrupted eviction. Returns the names removed."""
        if not self.root.is_dir():
            return []
        removed = []
        for path in self.root.iterdir():
            digest = path.name[len(TMP_PREFIX) : len(TMP_PREFIX) + 64]
            if not path.name.startswith(TMP_PREFIX) or not _DIGEST.fullmatch(digest):
                continue
            # Temp folders are only created under the digest's fetch lock.
            fetch_lock = self._lock_path(digest, "fetch")
            with locks.held(fetch_lock, locks.EXCLUSIVE, blocking=False) as free:
                if free:
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path.name)
        return removed

    def _touch(self, path: Path) -> None:
        """Record a use in the folder's mtime. An explicit, strictly increasing nanosecond
        stamp: the kernel's own "now" ticks coarsely, and two uses must not tie."""
        with self._guard:
            self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            stamp = self._last_stamp
        os.utime(path, ns=(stamp, stamp))

    def _lock_path(self, digest: str, kind: str) -> Path:
        folder = self.root / LOCKS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"{digest}.{kind}"

    def _thread_lock(self, digest: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(digest, threading.Lock())

    def _fetch_once(
        self, store: ObjectStore, prefix: str, manifest: Manifest, raw: bytes, final: Path
    ) -> bool:
        """Download and install unless another thread or process did meanwhile; says which."""
        digest = manifest.digest
        with (
            self._thread_lock(digest),
            locks.held(self._lock_path(digest, "fetch"), locks.EXCLUSIVE),
        ):
            if final.is_dir():
                return True
            self.remove_stale_tmp()
            self.evict(reserve=manifest.total_bytes)
            self._download(store, prefix, manifest, raw, final)
            return False

    def _try_evict(self, digest: str) -> bool:
        with self._guard:
            if digest in self._pins:
                return False
            use = self._lock_path(digest, "use")
            with locks.held(use, locks.EXCLUSIVE, blocking=False) as unused:
                if not unused:
                    return False  # pinned or being fetched by another process
                doomed = self.root / f"{TMP_PREFIX}{digest}-evicted-{secrets.token_hex(4)}"
                try:
                    os.rename(self.root / digest, doomed)  # gone at once, deleted at leisure
                except FileNotFoundError:
                    return False
        shutil.rmtree(doomed, ignore_errors=True)
        log.info("evicted snapshot %s from %s", digest, self.root)
        return True

    def _download(
        self, store: ObjectStore, prefix: str, manifest: Manifest, raw: bytes, final: Path
    ) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{manifest.digest}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            for f in manifest.files:
                download_verified(store, prefix + f.path, tmp / f.path, f)
            (tmp / MANIFEST_NAME).write_bytes(raw)
            try:
                os.rename(tmp, final)
            except OSError:
                # Another process installed the same digest first; its copy is as good.
                if not final.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
