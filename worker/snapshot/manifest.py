"""The snapshot manifest: what a snapshot folder holds, and the digest that names it.

A snapshot is identified by the digest of its manifest, not by its URI, so two URIs holding
the same bytes share one cache entry and a re-pushed snapshot with changed weights gets a new
one. The manifest lists every file with its size and sha256 so a worker can verify each file
while it streams in.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from hotpool.worker.snapshot.errors import SnapshotError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
KINDS = ("base", "instruct")
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ManifestFile:
    """One file of a snapshot; ``path`` is relative to the snapshot folder, ``/``-separated."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """Everything a worker needs to fetch, verify and load a snapshot."""

    format_version: int
    architecture: str
    dtype: str
    files: tuple[ManifestFile, ...]
    total_bytes: int
    # GGUF block types the snapshot keeps as they are (``gguf_blocks``), which deployments
    # with ``quantization: gguf`` serve; empty for snapshots without them.
    quantized: tuple[str, ...] = ()
    # ``base`` (continues text: /v1/completions) or ``instruct`` (follows a chat); None when
    # the snapshot's maker did not say (a folder or GGUF pushed as is).
    kind: str | None = None
    # What a deployment of it gets for the settings its request leaves out, as JSON text of
    # an object ({"quantization": "gguf", "default_max_tokens": 512}): the catalog's choice.
    serving: str | None = None

    @property
    def serving_defaults(self) -> dict[str, Any]:
        return json.loads(self.serving) if self.serving else {}

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "architecture": self.architecture,
            "dtype": self.dtype,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
            "total_bytes": self.total_bytes,
        }
        if self.quantized:  # absent otherwise: earlier manifests keep their digests
            body["quantized"] = list(self.quantized)
        if self.kind is not None:  # the same
            body["kind"] = self.kind
        if self.serving is not None:
            body["serving"] = self.serving_defaults
        return body

    @property
    def digest(self) -> str:
        """sha256 hex of the canonical JSON of every field; the snapshot's identity."""
        canonical = json.dumps(self._body(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        """The manifest as written to ``manifest.json``, with ``digest`` added for humans."""
        return {**self._body(), "digest": self.digest}

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse and validate a manifest; a wrong ``digest`` or unsafe path is a SnapshotError."""
        try:
            if not isinstance(data, dict):
                raise TypeError("manifest must be a JSON object")
            version = data["format_version"]
            if version != FORMAT_VERSION:
                raise SnapshotError(
                    f"unsupported manifest format_version {version!r} "
                    f"(this worker reads {FORMAT_VERSION})"
                )
            files = tuple(
                ManifestFile(path=_checked_path(f["path"]), size=int(f["size"]), sha256=f["sha256"])
                for f in data["files"]
            )
            manifest = cls(
                format_version=version,
                architecture=str(data["architecture"]),
                dtype=str(data["dtype"]),
                files=files,
                total_bytes=int(data["total_bytes"]),
                quantized=_quantized(data.get("quantized", [])),
                kind=_kind(data.get("kind")),
                serving=_serving(data.get("serving")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(f"malformed manifest: {exc!r}") from None
        if any(f.size < 0 or not _is_sha256(f.sha256) for f in files):
            raise SnapshotError("malformed manifest: a file has a negative size or a bad sha256")
        if len({f.path for f in files}) != len(files):
            raise SnapshotError("malformed manifest: a file is listed twice")
        if manifest.total_bytes != sum(f.size for f in files):
            raise SnapshotError("malformed manifest: total_bytes is not the sum of file sizes")
        claimed = data.get("digest")
        if claimed is not None and claimed != manifest.digest:
            raise SnapshotError(
                f"manifest digest mismatch: file says {claimed}, content hashes to "
                f"{manifest.digest} (manifest edited by hand or corrupted)"
            )
        return manifest


def _kind(value: object) -> str | None:
    if value is None or value in KINDS:
        return value  # type: ignore[return-value]
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {value!r}")


def _serving(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError("serving must be an object")
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _quantized(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"quantized must be a list of block type names, got {value!r}")
    return tuple(value)


def _is_sha256(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def _checked_path(path: object) -> str:
    """Reject paths that could escape the snapshot folder when a worker writes them."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"file path {path!r} is not a non-empty string")
    parts = PurePosixPath(path).parts
    if path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"file path {path!r} is not a plain relative path")
    if path == MANIFEST_NAME:
        raise ValueError(f"{MANIFEST_NAME} cannot list itself")
    return path


def hash_file(path: Path) -> tuple[int, str]:
    """``(size, sha256 hex)`` of a file, streamed so large weights never sit in memory."""
    hasher = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
            size += len(chunk)
    return size, hasher.hexdigest()


def build_manifest(
    folder: Path,
    architecture: str,
    dtype: str,
    quantized: tuple[str, ...] = (),
    kind: str | None = None,
    serving: dict[str, Any] | None = None,
) -> Manifest:
    """Hash every file under ``folder`` (recursively, sorted, except ``manifest.json``)."""
    paths = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST_NAME
    )
    if not paths:
        raise SnapshotError(f"{folder} holds no files to put in a snapshot")
    files = []
    for rel in paths:
        size, sha = hash_file(folder / rel)
        files.append(ManifestFile(path=_checked_path(rel), size=size, sha256=sha))
    return Manifest(
        format_version=FORMAT_VERSION,
        architecture=architecture,
        dtype=dtype,
        files=tuple(files),
        total_bytes=sum(f.size for f in files),
        quantized=quantized,
        kind=_kind(kind),
        serving=_serving(serving),
    )


def manifest_bytes(manifest: Manifest) -> bytes:
    """The exact bytes of ``manifest.json`` (indented for people who open it)."""
    return (json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n").encode()


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Write ``folder/manifest.json`` and return its path."""
    path = folder / MANIFEST_NAME
    path.write_bytes(manifest_bytes(manifest))
    return path


def read_manifest(source: Path | bytes) -> Manifest:
    """Read a manifest from a file (or a snapshot folder) or from the raw bytes of one."""
    if isinstance(source, Path):
        path = source / MANIFEST_NAME if source.is_dir() else source
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotError(f"no manifest at {path}") from None
    else:
        raw = source
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotError(f"manifest is not valid JSON: {exc}") from None
    return Manifest.from_json(data)
