"""Kernel programs (kernels/cpu_program.py): a decode forward's C kernel calls recorded once
per batch size and replayed from C. Held here to the eager engine's tokens, on a tiny bf16
model with int8 linears (every op native on any x86-64 or AArch64 CPU), and to falling back
where a forward computes outside the kernels."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_decode_graphs import _prompts, _run
from tiny_llama import TINY, tiny_model
from torch import nn

from hotpool.kernels import cpu_program, quant_ops
from hotpool.kernels.quant_linear import QuantizedLinear, for_device
from hotpool.kernels.quant_weight import Int8Weight, quantize_int8
from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.decode_graphs import cpu_batch_sizes, graphs_wanted
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.engine.spec.lengths import CHEAP_ROW
from hotpool.worker.models.llama import LlamaModel, ModelConfig
from hotpool.worker.protocol import SamplingParams, SpeculativeConfig

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not cpu_program.supported() or quant_ops.load() is None,
    reason="kernel programs need Linux on x86-64 or AArch64 and the C kernels",
)


def int8_tiny(cfg: ModelConfig = TINY) -> LlamaModel:
    """The tiny model in bf16 with every linear int8 on the C kernels."""
    model = tiny_model(cfg=cfg).to(torch.bfloat16)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                qw = for_device(Int8Weight(*quantize_int8(child.weight.detach())), CPU)
                setattr(parent, name, QuantizedLinear(qw, child.bias))
    return model


def _engine(model: LlamaModel, graphs: bool | None, **kw: object) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=1 << 20, cuda_graphs=graphs, **kw)  # type: ignore[arg-type]
    engine = LLMEngine(model, CPU, config)
    engine.capture_decode_graphs()
    return engine


def test_the_engine_replays_programs_and_generates_the_eager_tokens() -> None:
    prompts = _prompts(9)
    eager = _run(_engine(int8_tiny(), False, max_num_seqs=8), prompts)
    model = int8_tiny()
    assert graphs_wanted(CPU, model, {})
    assert not graphs_wanted(CPU, model, {"HOTPOOL_CPU_PROGRAMS": "0"})
    engine = _engine(model, None, max_num_seqs=8)
    graphs = engine.decode_graphs
    assert graphs is not None and graphs.sizes == (1, 2, 3, 4, 6, 8)
    assert _run(engine, prompts) == eager
    # Staggered arrivals: decode batches of several sizes, each recorded once and replayed.
    assert graphs.program_failure is None
    assert len(graphs._programs) >= 3
    assert graphs.replays > 2 * len(graphs._programs)


def test_a_replay_equals_a_fresh_forward_over_new_inputs() -> None:
    """The program reads the static buffers it was recorded over: new tokens and positions
    written there give the logits an eager forward computes for them."""
    model = int8_tiny()
    engine = _engine(model, None, max_num_seqs=4)
    graphs = engine.decode_graphs
    assert graphs is not None
    _run(engine, _prompts(2), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert 2 in graphs._programs or 1 in graphs._programs
    b = 2 if 2 in graphs._programs else 1
    program = graphs._programs[b]
    assert len(program) > 10 * TINY.num_hidden_layers // 2  # every layer's kernels
    graphs.vec[0, :b] = torch.tensor([7, 11][:b])
    graphs.vec[1, :b] = torch.tensor([3, 5][:b])
    graphs.vec[2, :b] = graphs.vec[1, :b] + 1
    program.run()
    replayed = graphs._logits[b].clone()
    with torch.inference_mode():
        eager = graphs._forward(b)  # the same inputs through the Python forward
    torch.testing.assert_close(replayed, eager, rtol=0, atol=0)


def test_a_token_outside_the_vocabulary_raises_in_a_replay() -> None:
    engine = _engine(int8_tiny(), None, max_num_seqs=1)
    graphs = engine.decode_graphs
    assert graphs is not None
    _run(engine, _prompts(1), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    graphs.vec[0, 0] = TINY.vocab_size
    with pytest.raises(IndexError, match="vocabulary"):
        graphs._programs[1].run()


def test_a_forward_computing_outside_the_kernels_is_not_recorded() -> None:
    """fp32 runs torch ops (nothing is recorded), and so does a scaled embedding's multiply
    in bf16: the engine notes why and then runs its steps eagerly, with the same tokens."""
    x = torch.ones(3)
    with cpu_program.ProgramRecorder() as recorder:
        x.add_(1)
    assert recorder.failure is not None and "aten.add_" in recorder.failure
    with pytest.raises(RuntimeError, match="no program"):
        recorder.program()

    scaled = replace(TINY, embed_scale=8.0)
    prompts = _prompts(4, seed=3)
    eager = _run(_engine(int8_tiny(scaled), False, max_num_seqs=4), prompts)
    engine = _engine(int8_tiny(scaled), None, max_num_seqs=4)
    assert _run(engine, prompts) == eager
    graphs = engine.decode_graphs
    assert graphs is not None and graphs.program_failure is not None
    assert "aten.mul" in graphs.program_failure and not graphs._programs
    assert not graphs.fits(1, 1)  # the engine chose programs: it stops taking steps

    fp32 = tiny_model()
    assert not graphs_wanted(CPU, fp32, {})  # torch ops in fp32: not even tried


def test_another_threads_kernel_calls_are_not_recorded() -> None:
    import threading

    from hotpool.kernels import cpu_ops

    kernels = cpu_ops.load()
    assert kernels is not None
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    with cpu_program.ProgramRecorder() as recorder:
        worker = threading.Thread(target=kernels.add_, args=(x, x))
        worker.start()
        worker.join()
        kernels.add_(x, x)
    assert [c.name for c in recorder.calls] == ["hp_add"]
    assert recorder.failure is None
    assert torch.equal(x, torch.full((2, 8), 4.0, dtype=torch.bfloat16))


# Prompts that repeat themselves, so n-gram proposals are made and (mostly) accepted.
LOOPY = [(5, 6, 7, 8, 9) * 6, (11, 12, 13) * 9 + (11,), (20, 21, 22, 23, 24, 25, 26) * 4]


@pytest.mark.parametrize("k", [1, 4, 6])
def test_speculative_steps_replay_and_keep_the_plain_greedy_tokens(k: int) -> None:
    """A request verifying k proposals is k + 1 rows of one decode batch: such steps replay
    the same programs as plain decodes, and greedy outputs stay those of plain decoding."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = _run(_engine(int8_tiny(), False, max_num_seqs=4), LOOPY, params)
    spec = SpeculativeConfig(num_tokens=k, max_batch=0)
    engine = _engine(int8_tiny(), None, max_num_seqs=4, speculative=spec)
    assert _run(engine, LOOPY, params) == plain
    stats = engine.stats()
    assert stats.spec_proposed > 0 and stats.spec_accepted > 0
    graphs = engine.decode_graphs
    assert graphs is not None and graphs.program_failure is None
    # Three requests, yet spans of k + 1 rows each: sizes past three were recorded.
    assert max(graphs._programs) > len(LOOPY)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_one_stream_verifies_its_proposals_in_programs() -> None:
    """The sizes cover k + 1 rows a speculating request (max_num_seqs=1 alone would
    record only size 1, and every verification would run eagerly), while the switch lets
    max_batch requests speculate."""
    spec = SpeculativeConfig(num_tokens=4)
    engine = _engine(int8_tiny(), None, max_num_seqs=1, speculative=spec)
    graphs = engine.decode_graphs
    assert graphs is not None and graphs.sizes == (1, 2, 3, 4, 6)
    # The costs the engine reads (each step that verified proposals reads one): replays
    # keep timing steps, so the cost after the run may differ from the one last read.
    costs: list[float | None] = []
    measured = graphs.row_cost

    def row_cost() -> float | None:
        costs.append(measured())
        return costs[-1]

    graphs.row_cost = row_cost  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = _run(_engine(int8_tiny(), False, max_num_seqs=1), LOOPY[:1], params)
    assert _run(engine, LOOPY[:1], params) == plain
    assert engine.stats().spec_accepted > 0
    assert max(graphs._programs) > 1  # spans replayed
    # Rejected requests pause unless a row is measured cheap (spec/lengths.py).
    assert costs and costs[-1] is not None and costs[-1] >= 0.0
    assert engine.spec_lengths.pauses == (costs[-1] > CHEAP_ROW)
    wide = _engine(int8_tiny(), None, max_num_seqs=16, speculative=spec)  # max_batch 4
    assert wide.decode_graphs is not None and wide.decode_graphs.sizes[-1] == 24


def test_a_draft_models_steps_replay_programs_too() -> None:
    """The target's capture captures its draft's engine: the draft's k greedy steps a
    verification replay recorded programs, and the target's output stays plain's."""
    from hotpool.worker.engine.spec.draft import DraftModelProposer

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = _run(_engine(int8_tiny(), False, max_num_seqs=2), LOOPY[:2], params)
    draft = DraftModelProposer(int8_tiny(), CPU, kv_cache_bytes=1 << 20, max_num_seqs=2)
    spec = SpeculativeConfig(method="draft", draft_snapshot="tiny", max_batch=0)
    config = EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=2, speculative=spec)
    engine = LLMEngine(int8_tiny(), CPU, config, proposer=draft)
    engine.capture_decode_graphs()
    assert _run(engine, LOOPY[:2], params) == plain
    assert engine.stats().spec_accepted > 0  # the draft is the target itself
    drafting = draft.engine.decode_graphs
    assert drafting is not None and drafting.program_failure is None
    assert drafting.replays > 0 and drafting._programs


def test_row_cost_is_the_measured_share_of_a_one_row_step_a_row() -> None:
    graphs = _engine(int8_tiny(), None, max_num_seqs=8).decode_graphs
    assert graphs is not None and graphs.row_cost() is None  # nothing replayed yet
    graphs._seconds = {1: 0.010}
    assert graphs.row_cost() is None
    graphs._seconds = {1: 0.010, 4: 0.016, 8: 0.040}
    assert graphs.row_cost() == pytest.approx(0.2)  # (16 - 10) / (3 rows x 10)
    graphs._seconds = {1: 0.010, 2: 0.009}
    assert graphs.row_cost() == 0.0


def test_cpu_sizes_pad_by_at_most_half() -> None:
    assert cpu_batch_sizes(1) == (1,)
    assert cpu_batch_sizes(5) == (1, 2, 3, 4, 6)
    assert cpu_batch_sizes(256)[-1] == 32  # larger batches run eagerly


def test_programs_keep_greedy_tokens_with_requests_coming_and_going() -> None:
    """Requests finish and arrive mid-run at other lengths: batch sizes shrink and grow
    across recorded sizes while earlier programs keep replaying."""
    engine = _engine(int8_tiny(), None, max_num_seqs=4)
    eager = _engine(int8_tiny(), False, max_num_seqs=4)
    outs: list[dict[str, list[int]]] = []
    for e in (eager, engine):
        got: dict[str, list[int]] = {}
        for i, n in enumerate([3, 9, 5, 12, 2]):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            e.add_request(
                EngineRequest(f"r{i}", tuple(range(10 + i, 20 + 2 * i)), params, frozenset())
            )
            for o in e.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        while e.has_unfinished():
            for o in e.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs.append(got)
    assert outs[0] == outs[1]
    assert [len(v) for v in outs[1].values()] == [3, 9, 5, 12, 2]


def test_quantized_deployments_compute_in_bf16_on_any_cpu_with_the_kernels() -> None:
    """The linears are the C kernels then, so bf16 is fast without native bf16 too (and
    records programs); a dense model keeps fp32 where torch would emulate bf16 matmuls."""
    from hotpool.worker.models.packed_linear import cpu_has_native_bf16
    from hotpool.worker.service import default_dtype

    assert default_dtype(CPU, "int8") == torch.bfloat16
    assert default_dtype(CPU, "gguf") == torch.bfloat16
    dense = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert default_dtype(CPU) == dense == default_dtype(CPU, "none")


def test_opaque_tensors_fail_the_recording_instead_of_raising() -> None:
    """oneDNN's packed weights (a dense bf16 linear on a CPU whose bf16 is oneDNN's, not
    hotpool's kernel) have no storage to look at: such an op is computation outside the
    kernels, and the recording fails cleanly (it used to raise NotImplementedError)."""
    x = torch.ones(4, 4)
    with cpu_program.ProgramRecorder() as recorder:
        dense = x.to_mkldnn().to_dense()
    assert torch.equal(dense, x)
    assert recorder.failure is not None and "to_mkldnn" in recorder.failure
