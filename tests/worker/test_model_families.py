"""Every supported family, saved by HF transformers and loaded by hotpool, gives HF's logits."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from family_models import (
    FAMILIES,
    GEMMA3,
    IDS,
    LLAMA3,
    PHI3_LONGROPE,
    QWEN3_MOE,
    SHAPE,
    THETA,
    hf_model,
)
from safetensors.torch import load_file, save_file

from hotpool.worker.models.attention import ContiguousAttention, SequenceKVCache
from hotpool.worker.models.llama import LlamaModel, RotaryEmbedding
from hotpool.worker.models.loader import ModelLoadError, load_model

transformers = pytest.importorskip("transformers")


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
    hf = hf_model(config_class, **overrides)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, torch.device("cpu"), torch.float32)
    expected = _hf_logits(hf, IDS)
    assert expected.std() > 0.5  # the weights are large enough to tell families apart
    torch.testing.assert_close(_logits(ours, IDS), expected, atol=1e-4, rtol=1e-4)


def test_scaled_rope_really_changes_the_logits() -> None:
    # Guards the test above: with these weights a wrong rope would not pass unnoticed.
    plain = _hf_logits(hf_model("LlamaConfig"), IDS)
    scaled = _hf_logits(hf_model("LlamaConfig", rope_scaling=LLAMA3), IDS)
    assert (plain - scaled).abs().max() > 1e-2


def test_transformers_v4_config_format_is_read(tmp_path: Path) -> None:
    # Checkpoints on the hub carry v4's top-level rope_theta and rope_scaling ("type" in
    # older ones) rather than v5's rope_parameters.
    hf = hf_model("LlamaConfig", rope_scaling=LLAMA3)
    hf.save_pretrained(tmp_path)
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_type"} | {"type": "llama3"}
    _edit_config(tmp_path, rope_parameters=None, rope_theta=THETA, rope_scaling=scaling)
    ours = load_model(tmp_path, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(_logits(ours, IDS), _hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_tied_checkpoint_that_also_stores_lm_head(tmp_path: Path) -> None:
    hf = hf_model("LlamaConfig", tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    (weights,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, weights, {"format": "pt"})
    ours = load_model(tmp_path, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(_logits(ours, IDS), _hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


# family, what HF builds, what we then change in its config.json, the error we expect
REFUSED: dict[str, tuple[str, dict[str, Any], dict[str, Any], str]] = {
    "partial-rotary": (
        "Phi3Config", {"pad_token_id": 0, "eos_token_id": 1},
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
        "partial_rotary_factor",
    ),
    "gemma2-attention-softcap": (
        "Gemma3TextConfig", GEMMA3, {"attn_logit_softcapping": 50.0}, "soft-capping"
    ),
    "moe-without-experts": (
        "Qwen3MoeConfig", QWEN3_MOE, {"num_experts_per_tok": 9}, "is not a MoE"
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
    hf_model(config_class, **overrides).save_pretrained(tmp_path)
    _edit_config(tmp_path, **edit)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_mistral_window_as_long_as_the_context_is_full_attention(tmp_path: Path) -> None:
    hf = hf_model("MistralConfig", sliding_window=None)
    hf.save_pretrained(tmp_path)
    _edit_config(tmp_path, sliding_window=SHAPE["max_position_embeddings"])
    ours = load_model(tmp_path, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(_logits(ours, IDS), _hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_sliding_window_and_layer_types_really_change_the_logits() -> None:
    # Guards the parity tests: with these weights a dropped window or a shared RoPE shows.
    gemma = _hf_logits(hf_model("Gemma3TextConfig", **GEMMA3), IDS)
    wide = _hf_logits(hf_model("Gemma3TextConfig", **{**GEMMA3, "sliding_window": 64}), IDS)
    one_theta = {
        k: {"rope_type": "default", "rope_theta": 5000.0} for k in GEMMA3["rope_parameters"]
    }
    shared = _hf_logits(
        hf_model("Gemma3TextConfig", **{**GEMMA3, "rope_parameters": one_theta}), IDS
    )
    assert (gemma - wide).abs().max() > 1e-2
    assert (gemma - shared).abs().max() > 1e-2


def test_longrope_long_factors_equal_hf_past_the_original_context() -> None:
    # Positions past the original context rotate with the long factors and the attention
    # factor, as HF's tables for a sequence that long.
    from hotpool.worker.models.families import phi3

    hf = hf_model("Phi3Config", **PHI3_LONGROPE)
    cfg = phi3.parse(hf.config.to_dict() | {"architectures": ["Phi3ForCausalLM"]})
    assert cfg.rope_scaling is not None and cfg.rope_scaling.attention_factor > 1.0
    ours = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                           cfg.rope_scaling)  # fmt: skip
    positions = torch.arange(60, 80)  # max + 1 > 64: HF takes the long factors
    x = torch.zeros(1, 1, len(positions), cfg.head_dim)
    cos, sin = hf.model.rotary_emb(x, positions[None])
    torch.testing.assert_close(ours.cos[positions[positions >= 64]], cos[0][positions >= 64])
    half = cfg.head_dim // 2  # our sin carries rotate_half's sign in its first half
    torch.testing.assert_close(
        ours.sin[positions[positions >= 64], half:], sin[0][positions >= 64, half:]
    )
    short = hf.model.rotary_emb(x[:, :, :4], torch.arange(4)[None])[0]
    torch.testing.assert_close(ours.cos[:4], short[0])


def test_moe_routing_equals_hf_for_every_token(tmp_path: Path) -> None:
    hf = hf_model("Qwen3MoeConfig", **QWEN3_MOE, norm_topk_prob=True)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, torch.device("cpu"), torch.float32)
    captured: dict[str, Any] = {}

    def keep(module: Any, args: Any, output: Any) -> None:
        captured["x"], captured["out"] = args[0], output

    hf.model.layers[1].mlp.gate.register_forward_hook(keep)
    _hf_logits(hf, IDS)
    _, hf_weights, hf_experts = captured["out"]
    weights, experts = ours.layers[1].feed_forward.route(captured["x"])
    assert torch.equal(experts, hf_experts)  # the same experts, in the same order
    torch.testing.assert_close(weights, hf_weights)
    assert len(set(experts.flatten().tolist())) > 2  # the batch spreads over experts


def test_moe_layer_where_some_experts_get_no_token() -> None:
    from hotpool.worker.models.config import MoEConfig
    from hotpool.worker.models.moe import SparseMoE

    torch.manual_seed(0)
    moe = SparseMoE(16, MoEConfig(num_experts=6, top_k=2, intermediate_size=8,
                                  norm_topk_prob=True, layers=(True,)))  # fmt: skip
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
        moe.gate.weight[4:] = -10.0  # with positive inputs, experts 4 and 5 never win
        x = torch.randn(5, 16).abs() + 0.1
        out = moe(x, lambda gu: torch.nn.functional.silu(gu[:, :8]) * gu[:, 8:])
        # Dense reference: every token through each of its experts.
        weights, experts = moe.route(x)
        assert not {4, 5} & set(experts.flatten().tolist())
        ref = torch.zeros_like(x)
        for t in range(5):
            for w, e in zip(weights[t], experts[t], strict=True):
                gu = moe.w13[e] @ x[t]
                ref[t] += w * (moe.w2[e] @ (torch.nn.functional.silu(gu[:8]) * gu[8:]))
    torch.testing.assert_close(out, ref)
