"""Object stores that hold snapshots, and pushing a local snapshot folder into one.

The worker reads snapshots through :class:`ObjectStore` only, so the embedded ``file://``
store and S3-compatible stores (a later issue) are interchangeable.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from hotpool.worker.snapshot.errors import ObjectNotFoundError, SnapshotError
from hotpool.worker.snapshot.manifest import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    Manifest,
    manifest_bytes,
    read_manifest,
)

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
    def delete_prefix(self, prefix: str) -> None: ...


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
        try:
            src = self._path(key).open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"no object {key!r} in {self.root}") from None
        with src, dest.open("wb") as out:
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

    def delete_prefix(self, prefix: str) -> None:
        for key in self.list(prefix):
            self._path(key).unlink(missing_ok=True)


def open_snapshot_uri(uri: str) -> tuple[ObjectStore, str]:
    """The store holding the snapshot at ``uri`` and the key prefix of its files.

    ``file:///abs/path/snap`` gives a :class:`FileObjectStore` rooted at the snapshot folder
    itself and the prefix ``""``, so keys are the manifest's relative paths. For object stores
    with buckets the prefix is the snapshot's folder inside the bucket, ending in ``/``.
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
        raise SnapshotError("s3:// object stores arrive with issue 5")
    raise SnapshotError(f"unsupported snapshot URI {uri!r}: expected file:// or s3://")


def push_snapshot(local_dir: Path, uri: str) -> Manifest:
    """Upload the snapshot in ``local_dir`` (which holds its ``manifest.json``) to ``uri``.

    The old manifest at ``uri`` goes first and the new one last, so a reader that finds a
    manifest always finds every file it lists, and never pairs an old manifest with new files.
    """
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
