"""Object stores that hold snapshots, and pushing a local snapshot folder into one.

The worker reads snapshots through :class:`ObjectStore` only, so the embedded ``file://``
store and S3-compatible stores (:mod:`hotpool.worker.snapshot.s3`) are interchangeable.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from hotpool.worker.snapshot.errors import ObjectNotFoundError, SnapshotError
from hotpool.worker.snapshot.manifest import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    Manifest,
    manifest_bytes,
    read_manifest,
)

if TYPE_CHECKING:
    from hotpool.worker.snapshot.s3 import S3Config

# Upload temp files start with this; listings skip them so readers never see half an object.
_PARTIAL_PREFIX = ".partial-"


class ObjectStore(ABC):
    """A flat namespace of immutable-looking objects addressed by ``/``-separated keys.

    Contract every backend keeps:

    - ``get_bytes(key)`` returns the whole object; for small objects such as manifests.
    - ``download(key, dest, chunk_cb)`` streams the object into the file ``dest`` (creating
      its parent folders), calling ``chunk_cb`` with each chunk in order, so the caller can
      hash while bytes arrive instead of re-reading the file. On failure ``dest`` may hold a
      partial file; the caller owns cleaning it up.
    - ``upload(src, key)`` makes the object appear whole or not at all: a concurrent reader
      sees the previous object or the new one, never a prefix of it.
    - ``list(prefix)`` returns the sorted keys that start with ``prefix`` (a plain string
      prefix, as in S3, not a folder).
    - ``exists(key)`` tells whether an object is stored under exactly ``key``.
    - ``delete(keys)`` removes exactly these objects; keys with no object are ignored.
    - ``delete_prefix(prefix)`` removes every object ``list(prefix)`` would return.

    A missing key raises :class:`ObjectNotFoundError`; other failures raise
    :class:`SnapshotError` naming the key.
    """

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def download(
        self, key: str, dest: Path, chunk_cb: Callable[[bytes], None] | None = None
    ) -> None: ...

    @abstractmethod
    def upload(self, src: Path, key: str) -> None: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, keys: Iterable[str]) -> None: ...

    def delete_prefix(self, prefix: str) -> None:
        self.delete(self.list(prefix))


class FileObjectStore(ObjectStore):
    """Objects as files under ``root``; the embedded store of ``hotpool serve``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        parts = PurePosixPath(key).parts
        if not key or key.startswith("/") or any(p in (".", "..") for p in parts):
            raise SnapshotError(f"invalid object key {key!r}")
        return self.root.joinpath(*parts)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"no object {key!r} in {self.root}") from None

    def download(
        self, key: str, dest: Path, chunk_cb: Callable[[bytes], None] | None = None
    ) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        path = self._path(key)
        try:
            src = path.open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"no object {key!r} in {self.root}") from None
        with src:
            if _linked(path, dest):
                # The same bytes, not a copy: a worker's cache on the store's file system
                # costs no disk and no write (a 369 MB snapshot took 2.2 s of a cold start
                # to copy). Safe to share: upload() replaces an object, never writes into it.
                # Still read once, for the caller's hash.
                while chunk_cb is not None and (chunk := src.read(CHUNK_BYTES)):
                    chunk_cb(chunk)
                return
            with dest.open("wb") as out:
                while chunk := src.read(CHUNK_BYTES):
                    if chunk_cb is not None:
                        chunk_cb(chunk)
                    out.write(chunk)

    def upload(self, src: Path, key: str) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_PARTIAL_PREFIX, dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out, src.open("rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    out.write(chunk)
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; other users' workers must read it
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def list(self, prefix: str) -> list[str]:
        if not self.root.is_dir():
            return []
        # Walk only the deepest folder the prefix names, not the whole store.
        folder, _, _ = prefix.rpartition("/")
        base = self._path(folder) if folder else self.root
        if not base.is_dir():
            return []
        keys = (
            p.relative_to(self.root).as_posix()
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(_PARTIAL_PREFIX)
        )
        return sorted(k for k in keys if k.startswith(prefix))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, keys: Iterable[str]) -> None:
        folders = set()
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            folders.update(p for p in path.parents if p.is_relative_to(self.root))
        # Folders have no meaning in an object store; leave none behind once empty.
        for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _linked(src: Path, dest: Path) -> bool:
    """Hard-link ``src`` at ``dest``; False where that cannot be (another file system, a
    file system without links, a read-only store's permissions): then it is copied."""
    try:
        os.link(src, dest)
    except OSError:
        return False
    return True


def open_snapshot_uri(uri: str, s3: S3Config | None = None) -> tuple[ObjectStore, str]:
    """The store holding the snapshot at ``uri`` and the key prefix of its files.

    ``file:///abs/path/snap`` gives a :class:`FileObjectStore` rooted at the snapshot folder
    itself and the prefix ``""``, so keys are the manifest's relative paths. For object stores
    with buckets the prefix is the snapshot's folder inside the bucket, ending in ``/``:
    ``s3://bucket/snapshots/x`` gives an :class:`S3ObjectStore` and ``"snapshots/x/"``.
    ``s3`` defaults to :meth:`S3Config.from_env` (``HOTPOOL_S3_ENDPOINT_URL``).
    """
    parts = urlsplit(uri)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise SnapshotError(
                f"snapshot URI {uri!r} must be file:///absolute/path (three slashes)"
            )
        path = unquote(parts.path).rstrip("/")
        if not path.startswith("/"):
            raise SnapshotError(f"snapshot URI {uri!r} must name an absolute path")
        return FileObjectStore(Path(path)), ""
    if parts.scheme == "s3":
        # Imported here: boto3 costs ~0.3 s to import, and file:// users never need it.
        from hotpool.worker.snapshot.s3 import open_s3_uri

        return open_s3_uri(uri, s3)
    raise SnapshotError(f"unsupported snapshot URI {uri!r}: expected file:// or s3://")


def push_snapshot(local_dir: Path, uri: str, manifest: Manifest | None = None) -> Manifest:
    """Upload the snapshot in ``local_dir`` to ``uri``; ``manifest`` defaults to the one in
    ``local_dir/manifest.json`` (pass one to push a folder without writing into it).

    The old manifest at ``uri`` goes first and the new one last, so a reader that finds a
    manifest always finds every file it lists, and never pairs an old manifest with new files.
    """
    if manifest is None:
        manifest = read_manifest(local_dir / MANIFEST_NAME)
    for f in manifest.files:
        try:
            size = (local_dir / f.path).stat().st_size
        except FileNotFoundError:
            raise SnapshotError(
                f"{local_dir / f.path} is listed in the manifest but missing"
            ) from None
        if size != f.size:
            raise SnapshotError(f"{local_dir / f.path} is {size} bytes, manifest says {f.size}")
    store, prefix = open_snapshot_uri(uri)
    store.delete_prefix(prefix + MANIFEST_NAME)
    for f in manifest.files:
        store.upload(local_dir / f.path, prefix + f.path)
    # Upload the canonical bytes rather than the local file, whatever its formatting.
    with tempfile.TemporaryDirectory() as tmp:
        canonical = Path(tmp) / MANIFEST_NAME
        canonical.write_bytes(manifest_bytes(manifest))
        store.upload(canonical, prefix + MANIFEST_NAME)
    return manifest
