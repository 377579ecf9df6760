"""Llama 2/3, SmolLM2, Mistral and Qwen2: the Llama block as it is, differing only in config
(GQA head counts, biases, RoPE scaling, tied embeddings, sliding windows)."""

from __future__ import annotations

from typing import Any

from hotpool.worker.models.config import ModelConfig, activation, shape_fields, sliding_layers
from hotpool.worker.models.rope import parse_rope


def parse(data: dict[str, Any]) -> ModelConfig:
    """Parse a HF ``config.json``; ValueError names what this model cannot run."""
    fields = shape_fields(data)
    activation(data)  # SwiGLU only
    theta, scaling = parse_rope(data)
    window, sliding = sliding_layers(data, fields["num_hidden_layers"])
    # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four.
    qwen2 = data.get("model_type") == "qwen2" or data.get("architectures") == ["Qwen2ForCausalLM"]
    attention_bias = bool(data.get("attention_bias", False))
    return ModelConfig(
        **fields,
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qwen2 or attention_bias,
        o_bias=attention_bias and not qwen2,
        mlp_bias=bool(data.get("mlp_bias", False)),
        family="qwen2" if qwen2 else "llama",
        sliding_window=window,
        layer_sliding=sliding,
    )
