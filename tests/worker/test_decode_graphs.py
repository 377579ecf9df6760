"""CUDA-graph decode (worker/engine/decode_graphs.py) without a GPU: the static-buffer runner
with ``capture=False`` replays each step eagerly over the same buffers a graph would read, so
padding, buffer reuse between steps and sizes, the scratch block and the choice of size are
held to the eager engine's output here. The capture itself runs on CUDA in
``benchmarks/gpu_serving.py`` (and the engine test in tests/kernels on a GPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_llama import TINY, tiny_model

from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.decode_graphs import graph_batch_sizes, graphs_wanted, padded_size
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.protocol import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Gemma-3-like: sliding layers beside a full one, so two layer groups, two block tables.
SLIDING = replace(TINY, num_hidden_layers=3, sliding_window=8, layer_sliding=(True, False, True))


def _prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(1, 90, (int(3 + 7 * (i % 4)),), generator=g).tolist())
            for i in range(n)]  # fmt: skip


def _run(
    engine: LLMEngine,
    prompts: list[tuple[int, ...]],
    params: SamplingParams = GREEDY,
    stagger: bool = True,
) -> dict[str, list[int]]:
    """Every prompt to its end; with ``stagger`` one arrives per step, so decode batches
    grow and shrink through several graph sizes."""
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for _ in range(1 if stagger else len(pending)):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(EngineRequest(f"r{i}", p, params, frozenset()))
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    return outs


def _engine(graphs: bool, model: torch.nn.Module | None = None, **kw: object) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=kw.pop("kv", 1 << 20), cuda_graphs=graphs, **kw)  # type: ignore[arg-type]
    engine = LLMEngine(model or tiny_model(), CPU, config)
    engine.capture_decode_graphs()
    return engine


def test_the_ladder_covers_every_decode_batch_and_pads_to_the_next_size() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert graph_batch_sizes(100)[-1] == 128  # a batch of 100 decodes has a graph
    sizes = graph_batch_sizes(256)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 17, 33, 200, 256)] == [
        1, 4, 8, 24, 48, 256, 256
    ]  # fmt: skip
    assert padded_size(257, sizes) is None  # runs eagerly
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def test_graphs_are_on_for_dense_models_on_cuda_and_off_by_the_variable() -> None:
    model = tiny_model()
    cuda = torch.device("cuda")
    assert graphs_wanted(cuda, model, {})
    assert not graphs_wanted(cuda, model, {"HOTPOOL_CUDA_GRAPHS": "0"})
    assert not graphs_wanted(CPU, model, {})
    engine = LLMEngine(model, CPU, EngineConfig(kv_cache_bytes=1 << 20))
    assert engine.decode_graphs is None and engine.capture_decode_graphs() == 0.0


@pytest.mark.parametrize("cfg", [TINY, SLIDING], ids=["llama", "sliding-window"])
def test_greedy_output_with_the_graph_runner_equals_eager(cfg: object) -> None:
    prompts = _prompts(11)
    eager = _run(_engine(False, tiny_model(cfg=cfg), max_num_seqs=16), prompts)  # type: ignore[arg-type]
    engine = _engine(True, tiny_model(cfg=cfg), max_num_seqs=16)  # type: ignore[arg-type]
    assert engine.decode_graphs is not None
    assert engine.decode_graphs.sizes == (1, 2, 4, 8, 16)
    assert _run(engine, prompts) == eager
    # Most steps were plain decodes, run through the buffers at several padded sizes.
    assert engine.decode_graphs.replays >= 8


def test_padding_rows_write_only_the_scratch_block() -> None:
    """Three decodes padded to four: the KV cache matches the eager engine's in every block
    of the pool (to rounding: a batch of four multiplies in other blocks than one of three),
    and the blocks no sequence holds stay zero; only the scratch block (past the pool) holds
    the padding's writes."""
    prompts = _prompts(3, seed=1)
    eager, graphed = _engine(False), _engine(True)
    for e in (eager, graphed):
        _run(e, prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), False)
    assert graphed.decode_graphs is not None and graphed.decode_graphs.replays == 4
    pool = eager.kv_manager.num_blocks
    assert graphed.kv_cache.num_blocks == pool + 1
    torch.testing.assert_close(graphed.kv_cache.storage[:, :, :, :pool], eager.kv_cache.storage)
    unused = eager.kv_cache.storage.abs().sum(dim=(0, 1, 2, 4, 5)) == 0
    assert unused.sum() > 0
    assert graphed.kv_cache.storage[:, :, :, :pool][:, :, :, unused].abs().sum() == 0
    assert graphed.kv_cache.storage[:, :, :, pool].abs().sum() > 0


def test_prefix_hits_preemption_and_sampling_keep_their_results() -> None:
    """A shared prefix (hits), a KV budget small enough to preempt, and seeded sampling with
    top-k/top-p and logprobs: the same tokens and logprobs as eager."""
    shared = tuple(range(5, 37))
    prompts = [shared + p for p in _prompts(6, seed=2)]
    params = SamplingParams(
        max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=7, logprobs=2, ignore_eos=True
    )

    def run(graphs: bool) -> tuple[dict[str, list[int]], int, int]:
        engine = _engine(graphs, kv=7 * 8192, max_num_seqs=8)  # 7 blocks
        out = _run(engine, prompts, params)
        stats = engine.stats()
        return out, stats.prefix_cache_hits, stats.num_preemptions

    eager, graphed = run(False), run(True)
    assert graphed == eager
    assert eager[1] > 0 and eager[2] > 0  # the case was exercised


def test_a_batch_above_the_largest_graph_and_proposals_run_eagerly() -> None:
    from hotpool.worker.protocol import SpeculativeConfig

    prompts = [tuple([3, 4, 5, 6] * 6)] * 2
    engine = _engine(True, max_num_seqs=1, speculative=SpeculativeConfig(max_batch=0))
    plain = _run(_engine(False, max_num_seqs=1), prompts)
    assert _run(engine, prompts) == plain
    stats = engine.stats()
    assert stats.spec_proposed > 0  # the verifying steps ran eagerly, beside the replays
