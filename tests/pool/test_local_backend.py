"""How the local backend splits a machine between worker processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hotpool.pool.backend import WorkerHandle
from hotpool.pool.local import LocalProcessBackend, LocalWorkerConfig, NoFreeGPU, visible_gpus


def _backend(tmp_path: Path, **kw: object) -> LocalProcessBackend:
    config = LocalWorkerConfig("http://127.0.0.1:9", "secret", tmp_path, tmp_path, **kw)  # type: ignore[arg-type]
    return LocalProcessBackend(config)


def test_each_worker_gets_its_own_gpu_until_none_is_free(tmp_path: Path) -> None:
    backend = _backend(tmp_path, gpus=("0", "3"))
    assert backend.worker_env("w1")["CUDA_VISIBLE_DEVICES"] == "0"
    assert backend.worker_env("w2")["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(NoFreeGPU, match="all 2 GPUs"):
        backend.worker_env("w3")


def test_a_stopped_worker_gives_its_gpu_back(tmp_path: Path) -> None:
    backend = _backend(tmp_path, gpus=("0",))
    backend.worker_env("w1")
    asyncio.run(backend.stop(WorkerHandle("w1")))  # never started: only the GPU to free
    assert backend.worker_env("w2")["CUDA_VISIBLE_DEVICES"] == "0"


def test_cpu_workers_get_their_share_of_threads_and_the_token(tmp_path: Path) -> None:
    env = _backend(tmp_path, threads=3).worker_env("w1")
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert env["HOTPOOL_WORKER_TOKEN"] == "secret"


def test_visible_gpus_follow_cuda_visible_devices() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ("2", "5")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == ()
