"""Every supported family, saved by HF transformers and loaded by hotpool, gives HF's logits."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotpool.worker.models.attention import ContiguousAttention, SequenceKVCache
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.models.loader import ModelLoadError, load_model

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
THETA = 500.0  # not the default, so a dropped theta shows
# 48 positions: past llama3's original length below (32), so its scaling matters.
IDS = [(7 * i * i + 3 * i + 1) % 100 for i in range(48)]
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 16 and theta 500 the wavelengths straddle 8 and 32, so all three of
    # llama3's bands (kept, blended, divided) are exercised.
    "original_max_position_embeddings": 32,
}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", {"rope_scaling": LLAMA3}),
    "linear-rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-biases": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 16}),
}


def _hf_model(config_class: str, **overrides: Any) -> Any:
    fields = {**SHAPE, **overrides}
    # transformers v5 keeps theta and scaling in one dict.
    rope = {"rope_theta": THETA, **fields.pop("rope_scaling", {"rope_type": "default"})}
    cfg = getattr(transformers, config_class)(
        **fields, rope_parameters=rope, attn_implementation="eager"
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not all-ones: a skipped norm must show
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:  # large enough that a missing bias or a wrong frequency shows
                p.normal_(0.0, 0.2)
    return model


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits for every position: a prefill of most of ``ids``, then two decode steps."""
    cfg = model.config
    cache = SequenceKVCache(cfg.num_hidden_layers, len(ids), cfg.num_key_value_heads, cfg.head_dim,
                            torch.float32, torch.device("cpu"))  # fmt: skip
    out, start = [], 0
    with torch.inference_mode():
        for n in (len(ids) - 2, 1, 1):
            t = torch.tensor(ids[start : start + n])
            hidden = model(t, torch.arange(start, start + n), ContiguousAttention(cache, start, n))
            out.append(model.logits(hidden))
            start += n
    return torch.cat(out)


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_checkpoint_matches_hf_logits(family: str, tmp_path: Path) -> None:
    config_class, overrides = FAMILIES[family]
    hf = _hf_model(config_class, **overrides)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, torch.device("cpu"), torch.float32)
    expected = _hf_logits(hf, IDS)
    assert expected.std() > 0.5  # the weights are large enough to tell families apart
    torch.testing.assert_close(_logits(ours, IDS), expected, atol=1e-4, rtol=1e-4)


def test_scaled_rope_really_changes_the_logits() -> None:
    # Guards the test above: with these weights a wrong rope would not pass unnoticed.
    plain = _hf_logits(_hf_model("LlamaConfig"), IDS)
    scaled = _hf_logits(_hf_model("LlamaConfig", rope_scaling=LLAMA3), IDS)
    assert (plain - scaled).abs().max() > 1e-2


def test_transformers_v4_config_format_is_read(tmp_path: Path) -> None:
    # Checkpoints on the hub carry v4's top-level rope_theta and rope_scaling ("type" in
    # older ones) rather than v5's rope_parameters.
    hf = _hf_model("LlamaConfig", rope_scaling=LLAMA3)
    hf.save_pretrained(tmp_path)
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_type"} | {"type": "llama3"}
    _edit_config(tmp_path, rope_parameters=None, rope_theta=THETA, rope_scaling=scaling)
    ours = load_model(tmp_path, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(_logits(ours, IDS), _hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_tied_checkpoint_that_also_stores_lm_head(tmp_path: Path) -> None:
    hf = _hf_model("LlamaConfig", tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    (weights,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, weights, {"format": "pt"})
    ours = load_model(tmp_path, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(_logits(ours, IDS), _hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


# family, what HF builds, what we then change in its config.json, the error we expect
REFUSED: dict[str, tuple[str, dict[str, Any], dict[str, Any], str]] = {
    "mistral-sliding-window": ("MistralConfig", {"sliding_window": 16}, {}, "sliding-window"),
    "qwen2-sliding-window": (
        "Qwen2Config", {}, {"use_sliding_window": True, "sliding_window": 16}, "sliding-window"
    ),
    "dynamic-rope": (
        "LlamaConfig", {}, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
        "rope type 'dynamic' is not supported",
    ),
    "v4-yarn-rope": (
        "LlamaConfig", {}, {"rope_parameters": None, "rope_scaling": {"type": "yarn"}}, "'yarn'"
    ),
    "llama3-rope-incomplete": (
        "LlamaConfig", {}, {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
        "lacks 'low_freq_factor'",
    ),
    "gelu": ("LlamaConfig", {}, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "biases-the-config-denies": (
        "LlamaConfig", {"attention_bias": True}, {"attention_bias": False},
        "tensors this config does not use",
    ),
    "biases-the-checkpoint-lacks": (
        "LlamaConfig", {}, {"mlp_bias": True}, "lacks tensor 'model.layers.0.mlp.gate_proj.bias'"
    ),
    "gpt2": ("LlamaConfig", {}, {"architectures": ["GPT2LMHeadModel"]}, "not supported"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_what_we_cannot_run_is_refused_at_load(case: str, tmp_path: Path) -> None:
    config_class, overrides, edit, message = REFUSED[case]
    _hf_model(config_class, **overrides).save_pretrained(tmp_path)
    _edit_config(tmp_path, **edit)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_mistral_window_as_long_as_the_context_is_full_attention(tmp_path: Path) -> None:
    hf = _hf_model("MistralConfig", sliding_window=None)
    hf.save_pretrained(tmp_path)
    _edit_config(tmp_path, sliding_window=SHAPE["max_position_embeddings"])
    ours = load_model(tmp_path, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(_logits(ours, IDS), _hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)
