"""Where a load's weights come from: the object store, the disk cache, or host memory."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from hotpool.heap import settle_heap
from hotpool.worker import service as service_module
from hotpool.worker.engine.llm_engine import EngineConfig
from hotpool.worker.host_cache import HostModelCache
from hotpool.worker.models.loader import ModelLoadError, load_model
from hotpool.worker.protocol import GenerateRequest, LoadRequest, SamplingParams
from hotpool.worker.service import WorkerService
from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.snapshot.manifest import build_manifest, write_manifest


async def _answer(service: WorkerService) -> str:
    req = GenerateRequest("t", SamplingParams(max_tokens=6, temperature=0.0), prompt="Paris is")
    return "".join([e.text async for e in service.generate(req)])


@pytest.mark.slow
def test_reload_comes_from_host_memory_then_disk_with_the_same_output(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    cache = SnapshotCache(tmp_path / "cache")
    service = WorkerService(
        cache, torch.device("cpu"), EngineConfig(kv_cache_bytes=32 << 20), HostModelCache(1 << 30)
    )
    req = LoadRequest("d", f"file://{smollm2_snapshot_bf16}")

    compilers: list[object] = []

    async def scenario() -> list[tuple[str, dict[str, float], str]]:
        seen = []
        for forget_host in (False, False, True):
            if forget_host:
                service.host_cache = HostModelCache(1 << 30)
            result = await service.load(req)
            assert cache.is_pinned(result.digest) == (result.tier != "host")
            # The structured-output compiler was built before the load answered (building
            # it holds the GIL: after, it froze a replica that had just said it was ready).
            assert service.loaded is not None and service.loaded.grammars_built
            compilers.append(service.loaded.grammars())
            seen.append((result.tier, result.phases, await _answer(service)))
            await service.unload()
            assert not cache.is_pinned(result.digest)  # unloading releases the disk copy
        return seen

    (first, second, third) = asyncio.run(scenario())
    assert [first[0], second[0], third[0]] == ["remote", "host", "disk"]
    # A re-warm from RAM kept the tokenizer and its compiler; a load from disk builds anew.
    assert compilers[1] is compilers[0] and compilers[2] is not compilers[0]
    assert second[1]["load"] == 0.0  # no weights read: they were still in RAM
    assert first[2] == second[2] == third[2] and first[2].strip()


def test_a_model_held_in_ram_serves_only_the_quantization_it_was_loaded_in(
    tmp_path: Path, smollm2_snapshot_bf16: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def load(path: Path, device: torch.device, dtype: torch.dtype, quantization: str) -> object:
        asked.append(quantization)
        return load_model(path, device, dtype)  # the quantizers have tests of their own

    monkeypatch.setattr(service_module, "load_model", load)
    service = WorkerService(
        SnapshotCache(tmp_path / "cache"),
        torch.device("cpu"),
        EngineConfig(kv_cache_bytes=8 << 20),
        HostModelCache(2 << 30),  # room for both (fp32 on a CPU without native bf16)
    )
    uri = f"file://{smollm2_snapshot_bf16}"
    plain, int8 = LoadRequest("d", uri), LoadRequest("d", uri, quantization="int8")

    async def scenario() -> list[str]:
        tiers = []
        for req in (plain, int8, int8, plain):
            tiers.append((await service.load(req)).tier)
            assert service.loaded is not None
            assert service.loaded.host_key.quantization == req.quantization
            await service.unload()
        return tiers

    # The int8 load reads the weights again (the plain model in RAM is not int8); each one
    # held in RAM serves its own quantization next time.
    assert asyncio.run(scenario()) == ["remote", "disk", "host", "host"]
    assert asked == ["none", "int8"]


def test_a_failed_load_leaves_nothing_pinned(tmp_path: Path, smollm2_snapshot_bf16: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(smollm2_snapshot_bf16, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    write_manifest(bad, build_manifest(bad, architecture="gpt2", dtype="bf16"))
    cache = SnapshotCache(tmp_path / "cache")
    settled: list[bool] = []
    config = EngineConfig(kv_cache_bytes=32 << 20)
    service = WorkerService(cache, torch.device("cpu"), config, settle_heap=settled.append)
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        asyncio.run(service.load(LoadRequest("d", f"file://{bad}")))
    assert service.loaded is None
    assert settled == []  # nothing was loaded: no heap to settle
    (entry,) = cache.entries()  # fetched and verified, then refused by the loader
    assert not cache.is_pinned(entry.digest)


def test_a_deployments_engine_options_reach_its_engine(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    settled: list[bool] = []

    def settle(thaw: bool) -> None:
        settled.append(thaw)
        settle_heap(thaw)

    service = WorkerService(
        SnapshotCache(tmp_path / "cache"),
        torch.device("cpu"),
        EngineConfig(kv_cache_bytes=32 << 20),
        HostModelCache(0),  # nothing kept in RAM: an unload drops the model
        settle_heap=settle,
    )
    req = LoadRequest(
        "d", f"file://{smollm2_snapshot_bf16}", max_model_len=24, kv_cache_bytes=8 << 20
    )

    async def scenario() -> weakref.ref[object]:
        await service.load(req)
        assert service.loaded is not None
        assert settled == [False]  # the new model's objects frozen, nothing thawed
        engine = service.loaded.engine.engine
        kv = engine.kv_cache
        # The machine's default dtype: bf16 where the CPU has it natively, else fp32.
        per_block = kv.bytes_per_block(30, 16, 3, 64, kv.storage.dtype)
        pool = (8 << 20) // per_block  # the deployment's budget, not 32m
        assert engine.kv_manager.num_blocks == pool
        # Where decode steps replay (kernel programs, CUDA graphs), the padding rows' scratch
        # block lies past the pool.
        assert kv.num_blocks == pool + (engine.decode_graphs is not None)
        long = GenerateRequest("t", SamplingParams(max_tokens=4), prompt="word " * 40)
        with pytest.raises(Exception, match="maximum context length is 24"):
            [e async for e in service.generate(long)]
        assert await _answer(service)  # a prompt that fits still runs
        model = weakref.ref(service.loaded.model)
        await service.unload()
        return model

    try:
        model = asyncio.run(scenario())
        assert settled == [False, True]
        assert model() is None  # dropped from RAM and freed: nothing of it stayed frozen
    finally:
        gc.unfreeze()  # the rest of the test process is collected as usual


@pytest.mark.slow
def test_a_worker_serves_the_snapshots_gguf_blocks_quantized(
    tmp_path: Path, smollm2_snapshot_blocks: Path, smollm2_snapshot_fp32: Path
) -> None:
    # The snapshot's blocks travel through the object store and the disk cache like its other
    # files (gguf/ is a folder of the snapshot), and the worker serves them as they are.
    service = WorkerService(
        SnapshotCache(tmp_path / "cache"),
        torch.device("cpu"),
        EngineConfig(kv_cache_bytes=32 << 20),
    )

    async def scenario() -> tuple[object, str, str]:
        await service.load(LoadRequest("d", f"file://{smollm2_snapshot_fp32}", "fp32"))
        dense = await _answer(service)
        await service.unload()
        await service.load(LoadRequest("d", f"file://{smollm2_snapshot_blocks}", "fp32",
                                       quantization="gguf"))  # fmt: skip
        assert service.loaded is not None
        report = service.loaded.engine.engine.runner.model.quantization
        answer = await _answer(service)
        await service.unload()
        return report, answer, dense

    report, answer, dense = asyncio.run(scenario())
    assert report.method == "gguf" and len(report.quantized) == 121  # type: ignore[attr-defined]
    # The dense snapshot is these very blocks dequantized to fp32: the same greedy answer.
    assert answer == dense and answer.strip()
    with pytest.raises(ModelLoadError, match="keeps no GGUF blocks"):
        asyncio.run(service.load(LoadRequest("d", f"file://{smollm2_snapshot_fp32}", "fp32",
                                             quantization="gguf")))  # fmt: skip


@pytest.mark.slow
def test_a_deployments_speculation_reaches_its_engine_and_heartbeat(
    tmp_path: Path, smollm2_snapshot_fp32: Path
) -> None:
    # n-gram and a draft model (SmolLM2 drafting for itself, fetched through the cache like
    # any snapshot): the same greedy answer as without, the figures in the heartbeat's info.
    from hotpool.worker.main import spec_stats

    service = WorkerService(
        SnapshotCache(tmp_path / "cache"),
        torch.device("cpu"),
        EngineConfig(kv_cache_bytes=32 << 20),
    )
    uri = f"file://{smollm2_snapshot_fp32}"
    policies = [
        None,
        {"method": "ngram", "num_tokens": 3, "max_batch": 0},
        {"method": "draft", "draft_snapshot": uri, "num_tokens": 3, "max_batch": 0},
    ]

    async def scenario() -> list[tuple[str, tuple[int | None, int | None, bool | None]]]:
        seen = []
        for policy in policies:
            await service.load(LoadRequest("d", uri, "fp32", speculative=policy))
            req = GenerateRequest(
                "t", SamplingParams(max_tokens=24, temperature=0.0),
                prompt="Repeat after me: one two three, one two three, one two three,",
            )  # fmt: skip
            answer = "".join([e.text async for e in service.generate(req)])
            seen.append((answer, spec_stats(service)))
            await service.unload()
        return seen

    (plain, none), (ngram, by_ngram), (draft, by_draft) = asyncio.run(scenario())
    assert none == (None, None, None) and plain.strip()
    assert ngram == plain and draft == plain
    assert by_ngram[0] and by_ngram[2] is True
    proposed, accepted, _ = by_draft
    assert proposed and accepted is not None and accepted >= 0.9 * proposed  # itself: ~all
    with pytest.raises(ModelLoadError, match="num_tokens"):
        asyncio.run(service.load(LoadRequest("d", uri, "fp32", speculative={"num_tokens": 99})))
