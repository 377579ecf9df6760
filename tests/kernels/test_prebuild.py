"""The CPU kernels are built before a request waits on them, once, however many ask."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hotpool.kernels import cpu_ops, prebuild, quant_ops
from hotpool.worker import idle_prep


@pytest.fixture
def empty_kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A machine that has never built the kernels (this process forgets its loaded ones)."""
    monkeypatch.setenv("HOTPOOL_KERNEL_CACHE", str(tmp_path))
    cpu_ops.load.cache_clear()
    quant_ops.load.cache_clear()
    yield tmp_path
    cpu_ops.load.cache_clear()  # later tests load the usual cache's builds again
    quant_ops.load.cache_clear()


@pytest.mark.slow
def test_a_background_build_and_a_load_meanwhile_compile_each_library_once(
    empty_kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker starts, idle, building the kernels; a model load asks for the kernels while it runs:
    the load waits for that build and gets its library, no second compiler runs."""
    compiles: list[str] = []
    real_run = subprocess.run

    def counting_run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        compiles.extend(Path(a).name for a in args if str(a).endswith(".c"))
        return real_run(args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counting_run)
    thread = idle_prep.prepare_in_background(torch.device("cpu"))  # a worker, starting
    ops, quant = cpu_ops.load(), quant_ops.load()  # what a load does, at once
    thread.join(timeout=300)
    assert ops is not None and quant is not None
    assert sorted(compiles) == ["cpu_ops.c", "quant_ops.c"]
    built = sorted(p.name.split("-")[0] for p in empty_kernel_cache.iterdir())
    assert built == ["cpu_ops", "quant_ops"]  # and no half-written build left beside them
    cpu_ops.load.cache_clear()  # a new worker process: it finds them built, compiles nothing
    quant_ops.load.cache_clear()
    prebuild.build_all()
    assert len(compiles) == 2
