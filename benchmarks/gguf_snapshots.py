"""The catalog models' GGUF files and the fp32 snapshots that keep their blocks, shared by
the benchmarks that serve quantization gguf (bench_quant.py, bench_engine.py)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hotpool.worker.snapshot.gguf import convert_gguf
from hotpool.worker.snapshot.model_catalog import catalog_model
from hotpool.worker.snapshot.pull import model_gguf

REPO = Path(__file__).resolve().parent.parent


def gguf_file(model: str) -> Path:
    """The catalog model's GGUF: the bench's download folder, else the tests' copy, else
    downloaded into the bench's folder."""
    entry = catalog_model(model)
    bench = REPO / ".cache" / "bench" / "downloads"
    test = REPO / ".cache" / "test" / model
    folder = test if not (bench / entry.gguf_path).is_file() and (
        test / entry.gguf_path
    ).is_file() else bench  # fmt: skip
    return model_gguf(entry, folder)


def blocks_snapshot(gguf: Path, model: str) -> Path:
    """fp32 snapshot of ``gguf`` with its blocks kept (converted once, then reused)."""
    out = REPO / ".cache" / "bench" / "objects" / "snapshots" / f"{model}-fp32-blocks"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=out.parent))
    try:
        convert_gguf(gguf, tmp, "fp32", chat=None, keep_blocks=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
