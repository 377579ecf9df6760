"""Gemma 3 (text): the Llama block with GeGLU, QK-norm, an RMSNorm on each sublayer's output
as well as its input, embeddings scaled by sqrt(hidden_size), a softmax scale of
``query_pre_attn_scalar ** -0.5``, sliding-window layers with a RoPE of their own (5 of
every 6), and tied embeddings. Gemma's RMSNorm scales by ``1 + w``; the 1 is added to the
weights at load, so the norms are plain ones at run time."""

from __future__ import annotations

from typing import Any

from hotpool.worker.models.config import ModelConfig, activation, shape_fields, sliding_layers
from hotpool.worker.models.rope import parse_rope_parameters
from hotpool.worker.models.weights import Part

NORM_OFFSET = 1.0


def parse(data: dict[str, Any]) -> ModelConfig:
    if data.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
    if data.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (EmbeddingGemma) is not supported")
    fields = shape_fields({"max_position_embeddings": 131072, **data})
    num_layers = fields["num_hidden_layers"]
    if "layer_types" not in data:  # transformers v4: every sliding_window_pattern-th is global
        pattern = int(data.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(num_layers)]  # fmt: skip
        data = {**data, "layer_types": types}
    window, sliding = sliding_layers({"sliding_window": 4096, **data}, num_layers)
    (theta, scaling), (local_theta, local_scaling) = _ropes(data)
    softcap = data.get("final_logit_softcapping")
    return ModelConfig(
        **fields,
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=bool(data.get("attention_bias", False)),
        o_bias=bool(data.get("attention_bias", False)),
        family="gemma3",
        qk_norm=True,
        sandwich_norms=True,
        activation=activation(data, "hidden_activation", "gelu_pytorch_tanh"),
        embed_scale=fields["hidden_size"] ** 0.5,
        attention_scale=float(data.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=None if softcap is None else float(softcap),
        sliding_window=window,
        layer_sliding=sliding,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


def _ropes(data: dict[str, Any]) -> tuple[tuple[float, Any], tuple[float, Any]]:
    """The global and the sliding layers' RoPE: v5's ``rope_parameters`` per layer type, or
    v4's ``rope_theta`` + ``rope_scaling`` (global) and ``rope_local_base_freq``."""
    params = data.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = parse_rope_parameters(params["full_attention"], data, 1_000_000.0)
        local = parse_rope_parameters(params.get("sliding_attention") or {}, {}, 10_000.0)
        return full, local
    full = parse_rope_parameters(
        params or data.get("rope_scaling") or {}, {"rope_theta": 1_000_000.0, **data}
    )
    local_theta = float(data.get("rope_local_base_freq", 10_000.0))
    return full, (local_theta, None)


def layer_parts(cfg: ModelConfig, layer: int) -> dict[str, Part]:
    def norm(name: str) -> Part:
        return Part((name,), offset=NORM_OFFSET)

    return {
        "attention_norm": norm("input_layernorm"),
        "post_attention_norm": norm("post_attention_layernorm"),
        "ffn_norm": norm("pre_feedforward_layernorm"),
        "post_ffn_norm": norm("post_feedforward_layernorm"),
        "attention.q_norm": norm("self_attn.q_norm"),
        "attention.k_norm": norm("self_attn.k_norm"),
        "attention.wqkv": Part(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), cfg.qkv_bias
        ),
        "attention.wo": Part(("self_attn.o_proj",), cfg.o_bias),
        "feed_forward.w13": Part(("mlp.gate_proj", "mlp.up_proj")),
        "feed_forward.w2": Part(("mlp.down_proj",)),
    }
