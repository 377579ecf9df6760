"""Tiny random-weight HF models of every supported family, built from real config shapes."""

from __future__ import annotations

from typing import Any

import torch

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

# Phi-3's LongRoPE: 8 factors for head_dim 16; the original context (64) is past IDS, so the
# short factors apply (the long ones are checked against HF's tables below).
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.5, 7.0, 9.0],
    "original_max_position_embeddings": 64,
}
PHI3_LONGROPE = {
    "pad_token_id": 0, "eos_token_id": 1, "rope_scaling": LONGROPE,
    "original_max_position_embeddings": 64,  # 256 / 64: attention factor sqrt(1 + ln 4 / ln 64)
}  # fmt: skip
# Gemma 3: the window (8) is far shorter than IDS (48); both layer types; a query scale,
# local and global RoPE thetas and a logit cap that differ from the defaults.
GEMMA3 = {
    "head_dim": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "num_hidden_layers": 3,
    "query_pre_attn_scalar": 32,
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
    },
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
}  # fmt: skip
QWEN3_MOE = {
    "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "mlp_only_layers": [0],  # layer 0 dense, layer 1 sparse
}  # fmt: skip

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", {"rope_scaling": LLAMA3}),
    "linear-rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-biases": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 16}),
    "mistral-sliding-window": ("MistralConfig", {"sliding_window": 16, "head_dim": 16}),
    "qwen2-sliding-window": (
        "Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),  # head_dim != hidden / heads
    "qwen3-moe": ("Qwen3MoeConfig", {**QWEN3_MOE, "norm_topk_prob": True}),
    "qwen3-moe-unnormed": ("Qwen3MoeConfig", {**QWEN3_MOE, "norm_topk_prob": False}),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "eos_token_id": 1}),
    "phi3-longrope": ("Phi3Config", PHI3_LONGROPE),
    "phi3-sliding-window": (
        "Phi3Config", {"pad_token_id": 0, "eos_token_id": 1, "sliding_window": 12}
    ),
    "gemma3": ("Gemma3TextConfig", GEMMA3),
}  # fmt: skip


def hf_model(config_class: str, **overrides: Any) -> Any:
    """A HF model of ``config_class`` with random weights large enough to tell families apart."""
    import transformers

    fields = {**SHAPE, **overrides}
    # transformers v5 keeps theta and scaling in one dict (Gemma 3: one per layer type).
    rope = {"rope_theta": THETA, **fields.pop("rope_scaling", {"rope_type": "default"})}
    rope = fields.pop("rope_parameters", rope)
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
