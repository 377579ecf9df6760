"""SmolLM2 through hotpool's loader, tokenizer and batching engine vs HF transformers.

HF generates the prompts in left-padded batches (its attention mask and position ids do the
rest: in fp32 each output is the one it gives the prompt alone); hotpool gets them
concurrently, with staggered arrivals and a small token budget, so its steps mix prefill
chunks and decodes. Float rounding differs between batch shapes, so (vLLM's
``check_logprobs_close`` rule) a divergence is allowed only at a near-tie, where each side's
token is in the other's top-5.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from hotpool.worker.engine.base import EngineRequest, RequestOutput
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.loader import DTYPES, load_model
from hotpool.worker.protocol import ChatMessage, SamplingParams
from hotpool.worker.tokenizer import TextTokenizer

PROMPTS = [
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
NEW_TOKENS = 64
TOP = 5


EOS = 2


def _hf_generate_all(hf: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[set[int]]]]:
    """:func:`_hf_generate` over batches of prompts of like lengths (the longest at most
    twice the shortest): padding a short prompt to a long one costs the compute of the pad."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: dict[int, tuple[list[int], list[set[int]]]] = {}
    while order:
        batch = [i for i in order if len(prompts[i]) <= 2 * len(prompts[order[0]])]
        order = order[len(batch) :]
        results.update(zip(batch, _hf_generate(hf, [prompts[i] for i in batch]), strict=True))
    return [results[i] for i in range(len(prompts))]


def _hf_generate(hf: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[set[int]]]]:
    """Each prompt's greedy tokens (up to its EOS) and the top-5 ids at each of them."""
    width = max(len(ids) for ids in prompts)
    padded = torch.tensor([[EOS] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    with torch.inference_mode():
        out = hf.generate(
            padded, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=EOS, pad_token_id=EOS, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    results = []
    for row in range(len(prompts)):
        tokens = out.sequences[row, width:].tolist()
        if EOS in tokens:  # a finished row is padded with EOS to the batch's end
            tokens = tokens[: tokens.index(EOS) + 1]
        tops = [set(torch.topk(step[row].float(), TOP).indices.tolist()) for step in out.logits]
        results.append((tokens, tops[: len(tokens)]))
    return results


def _diverges_only_at_a_near_tie(
    ours: list[RequestOutput], hf: list[int], hf_top: list[set[int]]
) -> bool:
    """True if identical; True if the first difference is a near-tie; False otherwise."""
    mine = [o.new_token_ids[0] for o in ours]
    for j, (a, b) in enumerate(zip(mine, hf, strict=False)):
        if a != b:
            our_top = {t for t, _ in ours[j].logprobs[0].top_logprobs}
            return a in hf_top[j] and b in our_top
    return len(mine) == len(hf)


@pytest.fixture(scope="module")
def hf_smollm2_bf16(hf_smollm2_model: Any) -> Any:
    return copy.deepcopy(hf_smollm2_model).to(torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_concurrent_staggered_greedy_matches_hf_transformers(
    dtype: str, hf_smollm2_tokenizer: Any, request: pytest.FixtureRequest
) -> None:
    """In float32 (torch ops) and in bfloat16, the CPU default (the fused C kernels, where
    they build): HF runs the same dtype."""
    snapshot: Path = request.getfixturevalue(f"smollm2_snapshot_{dtype}")
    hf_model = request.getfixturevalue("hf_smollm2_model" if dtype == "fp32" else "hf_smollm2_bf16")
    tok = TextTokenizer(snapshot)
    prompts = []
    for text in PROMPTS:
        ids = tok.encode(tok.apply_chat_template([ChatMessage("user", text)]))
        hf_ids = hf_smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        hf_ids = hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids
        assert ids == list(hf_ids), "chat template + tokenizer differ from HF's"
        prompts.append(ids)
    assert len({len(p) for p in prompts}) >= 8  # prompts of different lengths

    model = load_model(snapshot, torch.device("cpu"), DTYPES[dtype])
    engine = LLMEngine(model, torch.device("cpu"), EngineConfig(max_num_batched_tokens=96))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=TOP)
    outs: dict[str, list[RequestOutput]] = {}
    step = 0
    while step == 0 or engine.has_unfinished():
        if step % 3 == 0 and step // 3 < len(prompts):  # staggered arrivals
            i = step // 3
            engine.add_request(EngineRequest(f"p{i}", tuple(prompts[i]), params, tok.eos_token_ids))
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        step += 1
    assert len(outs) == len(prompts)

    near_ties = []
    agreed = 0  # tokens before the first divergence, over all prompts
    for i, (hf_tokens, hf_top) in enumerate(_hf_generate_all(hf_model, prompts)):
        ours = outs[f"p{i}"]
        mine = [o.new_token_ids[0] for o in ours]
        agreed += next(
            (j for j, (a, b) in enumerate(zip(mine, hf_tokens, strict=False)) if a != b),
            min(len(mine), len(hf_tokens)),
        )
        if mine != hf_tokens:
            why = f"prompt {i}:\n ours {tok.decode(mine)!r}\n hf   {tok.decode(hf_tokens)!r}"
            assert _diverges_only_at_a_near_tie(ours, hf_tokens, hf_top), why
            near_ties.append(i)
        if i == 0:
            assert "Paris" in tok.decode(mine)
    print(f"{dtype}: {agreed} of {len(prompts) * NEW_TOKENS} tokens agree; near ties {near_ties}")
    # bfloat16 keeps 8 bits of mantissa: a different batch shape flips near-ties far more
    # often (measured: 4-6 of 9 prompts diverge, with torch ops and fused kernels alike, after
    # 155-245 of 576 tokens agree). Every divergence must still be a near-tie.
    if dtype == "fp32":
        assert len(near_ties) <= 1, f"near-tie divergences in prompts {near_ties}"
