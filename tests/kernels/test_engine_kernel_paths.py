"""Engine level: greedy generation through the Triton kernels (paged attention and the
sampler; the CPU interpreter here, compiled on CUDA) equals the torch reference paths."""

from __future__ import annotations

import pytest
import torch

from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.llama import LlamaModel, ModelConfig, RotaryEmbedding
from hotpool.worker.protocol import SamplingParams

# Small, with a head dim the Triton attention kernels support (64).
CFG = ModelConfig(
    vocab_size=101, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
    bos_token_id=None, eos_token_ids=(100,),
)  # fmt: skip
PROMPTS = [[(5 * i + 3 * j) % 97 + 1 for j in range(n)] for i, n in enumerate([1, 9, 17, 30])]


def _model() -> LlamaModel:
    torch.manual_seed(0)
    model = LlamaModel(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.rope = RotaryEmbedding(CFG.head_dim, CFG.rope_theta, CFG.max_position_embeddings)
    return model.eval()


def _generate(
    attention: str, sampler: str, device: str = "cpu", graphs: bool = False
) -> dict[str, list[int]]:
    config = EngineConfig(
        kv_cache_bytes=4 << 20,
        max_num_batched_tokens=16,  # chunked prefill shares steps with decodes
        attention_backend=attention,
        sampler_backend=sampler,
        cuda_graphs=graphs,
    )
    engine = LLMEngine(_model().to(device), torch.device(device), config)
    assert engine.runner.attention.name == attention
    engine.capture_decode_graphs()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outs: dict[str, list[int]] = {}
    step = 0
    while step == 0 or engine.has_unfinished():
        if step < len(PROMPTS):  # staggered arrivals
            engine.add_request(EngineRequest(f"p{step}", tuple(PROMPTS[step]), params, frozenset()))
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    return outs


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Triton compiles for it alone")
def test_greedy_is_identical_on_the_triton_and_reference_paths() -> None:
    reference = _generate("torch", "reference")
    assert _generate("triton", "triton") == reference
    assert _generate("torch", "torch") == reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (benchmarks/gpu_kernels.py)")
def test_greedy_on_cuda_is_identical_on_the_triton_and_reference_paths() -> None:
    """On CUDA the engine picks the compiled kernels by itself; they agree with the torch
    paths there and with the CPU reference."""
    reference = _generate("torch", "reference", "cuda")
    assert _generate("triton", "triton", "cuda") == reference
    assert _generate("torch", "torch", "cuda") == reference
    assert reference == _generate("torch", "reference")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (benchmarks/gpu_kernels.py)")
def test_greedy_with_cuda_graphs_equals_eager_on_cuda() -> None:
    """Decode steps replayed from captured CUDA graphs (padded batch sizes, staggered
    arrivals) give the eager engine's tokens."""
    assert _generate("triton", "triton", "cuda", graphs=True) == _generate(
        "triton", "triton", "cuda"
    )


def test_unknown_backends_are_rejected() -> None:
    with pytest.raises(ValueError, match="attention backend"):
        LLMEngine(_model(), torch.device("cpu"), EngineConfig(attention_backend="cuda"))
    with pytest.raises(ValueError, match="native kernels need"):
        LLMEngine(_model(), torch.device("cpu"), EngineConfig(attention_backend="native"))
