"""SmolLM2 through hotpool's loader, tokenizer and engine vs HF transformers on the same GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.simple import SimpleEngine
from hotpool.worker.models.loader import load_model
from hotpool.worker.protocol import ChatMessage, SamplingParams
from hotpool.worker.tokenizer import TextTokenizer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
    "List three colors of the rainbow.",
]
NEW_TOKENS = 32


@pytest.mark.slow
def test_greedy_tokens_match_hf_transformers_on_four_chat_prompts(
    hf_smollm2_tokenizer: Any, hf_smollm2_model: Any, smollm2_snapshot_fp32: Path
) -> None:
    hf_tok, hf = hf_smollm2_tokenizer, hf_smollm2_model

    tok = TextTokenizer(smollm2_snapshot_fp32)
    engine = SimpleEngine(
        load_model(smollm2_snapshot_fp32, torch.device("cpu")), torch.device("cpu")
    )
    for i, prompt in enumerate(PROMPTS):
        text = tok.apply_chat_template([ChatMessage("user", prompt)])
        ids = tok.encode(text)
        hf_ids = hf_tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        hf_ids = (
            hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
        )
        assert ids == list(hf_ids), "chat template + tokenizer differ from HF's"

        with torch.inference_mode():
            hf_out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )[0, len(ids) :].tolist()

        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
        engine.add_request(EngineRequest(f"p{i}", tuple(ids), params, tok.eos_token_ids))
        ours: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                ours.extend(out.new_token_ids)
        assert ours == hf_out, (
            f"prompt {prompt!r}:\n ours {tok.decode(ours)!r}\n hf   {tok.decode(hf_out)!r}"
        )
        if i == 0:
            assert "Paris" in tok.decode(ours)
