"""Every new family through the engine: paged cache, chunked prefill, decode, prefix caching
on and off, prompts longer than the sliding window — against HF's logits of the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from family_models import FAMILIES, hf_model

from hotpool.worker.engine.base import EngineRequest, RequestOutput
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.loader import load_model
from hotpool.worker.protocol import SamplingParams

pytest.importorskip("transformers")

CPU = torch.device("cpu")
# A shared 16-token prefix (4 blocks of 4), then each prompt's own tail: 22 and 20 tokens,
# longer than every sliding window below (6 to 16).
PREFIX = [(5 * i * i + 7 * i + 3) % 97 + 2 for i in range(16)]
PROMPTS = [[*PREFIX, 11, 23, 35, 47, 59, 71], [*PREFIX, 13, 29, 41, 53]]
NEW_TOKENS = 6
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": FAMILIES["qwen3"],
    "qwen3-moe": FAMILIES["qwen3-moe"],
    "phi3-longrope": FAMILIES["phi3-longrope"],
    "gemma3": FAMILIES["gemma3"],
    "mistral-sliding-window": ("MistralConfig", {"sliding_window": 6, "head_dim": 16}),
}


def _run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """The second prompt arrives after the first has finished (so its prefix is cached)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outs: dict[str, list[RequestOutput]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"r{i}", tuple(prompt), params, frozenset()))
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("family", CASES)
def test_engine_generates_what_hf_predicts(family: str, caching: bool, tmp_path: Path) -> None:
    config_class, overrides = CASES[family]
    hf = hf_model(config_class, **overrides)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, CPU, torch.float32)
    # Small blocks and a small token budget: windows cross blocks, prefills run in chunks.
    config = EngineConfig(block_size=4, kv_cache_bytes=1 << 22, max_num_batched_tokens=8,
                          enable_prefix_caching=caching, attention_backend="torch")  # fmt: skip
    engine = LLMEngine(model, CPU, config)
    outs = _run(engine)
    for i, prompt in enumerate(PROMPTS):
        steps = outs[f"r{i}"]
        tokens = [t for o in steps for t in o.new_token_ids]
        logprobs = [lp.logprob for o in steps for lp in o.logprobs]
        assert len(tokens) == NEW_TOKENS
        with torch.inference_mode():
            logits = hf(torch.tensor([[*prompt, *tokens]])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        assert tokens == expected.argmax(dim=-1).tolist(), f"prompt {i}"
        chosen = expected[torch.arange(NEW_TOKENS), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(logprobs), chosen, atol=1e-4, rtol=1e-4)
    cached = steps[0].num_cached_tokens
    assert cached == (16 if caching else 0)  # the shared prefix's 4 full blocks


def test_a_sliding_window_model_holds_a_bounded_number_of_blocks(tmp_path: Path) -> None:
    # Every layer of this Mistral slides (window 6): blocks behind the window go back to the
    # pool as the sequence grows, and the tokens still equal HF's.
    hf = hf_model("MistralConfig", sliding_window=6, head_dim=16)
    hf.save_pretrained(tmp_path)
    engine = LLMEngine(load_model(tmp_path, CPU, torch.float32), CPU,
                       EngineConfig(block_size=4, kv_cache_bytes=1 << 22, max_num_batched_tokens=8,
                                    attention_backend="torch"))  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("r", tuple(PROMPTS[0]), params, frozenset()))
    free_at_start = engine.kv_manager.num_free_blocks
    tokens: list[int] = []
    most_held = 0
    while engine.has_unfinished():
        for o in engine.step():
            tokens.extend(o.new_token_ids)
        most_held = max(most_held, free_at_start - engine.kv_manager.num_free_blocks)
    # 62 tokens span 16 blocks; the window (6) plus a chunk (8) needs at most 5 of them.
    assert most_held <= 5
    with torch.inference_mode():
        logits = hf(torch.tensor([[*PROMPTS[0], *tokens]])).logits[0]
    assert tokens == logits[len(PROMPTS[0]) - 1 : -1].argmax(dim=-1).tolist(), most_held


def test_gemma3_frees_its_sliding_layers_blocks_and_keeps_the_global_ones(
    tmp_path: Path,
) -> None:
    # Gemma 3 mixes sliding (window 8) and full layers: its cache has a layer group per kind,
    # the sliding groups release blocks behind the window, and the tokens still equal HF's.
    config_class, overrides = FAMILIES["gemma3"]
    hf = hf_model(config_class, **overrides)
    hf.save_pretrained(tmp_path)
    engine = LLMEngine(load_model(tmp_path, CPU, torch.float32), CPU,
                       EngineConfig(block_size=4, kv_cache_bytes=1 << 22, max_num_batched_tokens=8,
                                    attention_backend="torch"))  # fmt: skip
    assert engine.kv_manager.windows == (None, 8, 8)  # layers: sliding, full, sliding
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("r", tuple(PROMPTS[0]), params, frozenset()))
    free_at_start = engine.kv_manager.num_free_blocks
    tokens: list[int] = []
    most_held = 0
    while engine.has_unfinished():
        for o in engine.step():
            tokens.extend(o.new_token_ids)
        most_held = max(most_held, free_at_start - engine.kv_manager.num_free_blocks)
    # 62 tokens span 16 blocks: the full group holds all of them, each sliding group at most
    # the window (8) plus a chunk (8): 5. A page holds one layer here (groups of one), so
    # that is 26 layer-blocks of memory, where one table for the three layers held 3 x 16.
    assert engine.kv_groups.slots == 1
    assert 16 < most_held <= 16 + 2 * 5
    with torch.inference_mode():
        logits = hf(torch.tensor([[*PROMPTS[0], *tokens]])).logits[0]
    assert tokens == logits[len(PROMPTS[0]) - 1 : -1].argmax(dim=-1).tolist(), most_held
