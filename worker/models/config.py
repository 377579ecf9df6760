"""What a decoder checkpoint is, as one frozen dataclass every model family parses into.

All families hotpool runs are the Llama block with a few switches (see
:mod:`hotpool.worker.models.families`): QK-norm (Qwen3, Gemma 3), norms on each sublayer's
output (Gemma 3), GeGLU, a scaled embedding, a softmax scale of its own, sliding-window
layers, a second RoPE for those layers, final logit soft-capping, and a mixture-of-experts
MLP (Qwen3-MoE). The engine, scheduler and KV manager read only the shape fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hotpool.worker.models.rope import RopeScaling

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: ``top_k`` of ``num_experts`` experts per token, on ``layers[i]`` True."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool  # renormalize the k chosen probabilities to sum to 1
    layers: tuple[bool, ...]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    family: str = "llama"
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE
    sandwich_norms: bool = False  # an RMSNorm on the attention and MLP outputs too (Gemma)
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    # The attention softmax scale when it is not head_dim ** -0.5 (Gemma's
    # query_pre_attn_scalar ** -0.5); the model folds the difference into the queries.
    attention_scale: float | None = None
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    layer_sliding: tuple[bool, ...] = ()  # per layer; empty = no sliding layers
    # Sliding layers' own RoPE (Gemma 3: theta 10k locally, 1M on the global layers).
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.layer_sliding and len(self.layer_sliding) != self.num_hidden_layers:
            raise ValueError(
                f"{len(self.layer_sliding)} layer types for {self.num_hidden_layers} layers"
            )
        if any(self.layer_sliding) and (self.sliding_window or 0) < 1:
            raise ValueError(f"sliding layers need a positive sliding_window, got "
                             f"{self.sliding_window!r}")  # fmt: skip
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation {self.activation!r} is not supported")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends to the whole context)."""
        if self.layer_sliding and self.layer_sliding[layer]:
            return self.sliding_window
        return None

    @property
    def uniform_window(self) -> int | None:
        """The window when *every* layer slides: then KV blocks behind it can be freed."""
        if self.layer_sliding and all(self.layer_sliding):
            return self.sliding_window
        return None


def eos_ids(data: dict[str, Any]) -> tuple[int, ...]:
    eos = data.get("eos_token_id")
    if isinstance(eos, list):
        return tuple(int(e) for e in eos)
    return () if eos is None else (int(eos),)


def activation(data: dict[str, Any], key: str = "hidden_act", default: str = "silu") -> str:
    name = data.get(key) or default
    if name not in ACTIVATIONS:
        raise ValueError(f"{key} {name!r} is not supported (have {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def sliding_layers(data: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """``(sliding_window, per-layer flags)`` as HF reads them.

    ``layer_types`` (transformers v5) wins; otherwise a ``sliding_window`` applies to every
    layer unless ``use_sliding_window`` is false (Qwen2/Qwen3, whose configs carry a window
    they do not use) or, with Qwen's ``max_window_layers``, to the layers from that index on.
    A window at least as long as the context is full attention (Mistral v0.2+ sets none).
    """
    window = data.get("sliding_window")
    types = data.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported")
        flags = tuple(t == "sliding_attention" for t in types)
    elif window is None or not data.get("use_sliding_window", True):
        flags = (False,) * num_layers
    else:
        first = int(data.get("max_window_layers") or 0)
        flags = tuple(i >= first for i in range(num_layers))
    if not any(flags):
        return None, ()
    if window is None or int(window) < 1:
        raise ValueError(f"sliding layers need a positive sliding_window, got {window!r}")
    if int(window) >= int(data.get("max_position_embeddings", 2048)):
        return None, ()  # the window covers the whole context
    return int(window), flags


def shape_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The fields every family reads the same way from a HF ``config.json``."""
    heads = int(data["num_attention_heads"])
    return {
        "vocab_size": int(data["vocab_size"]),
        "hidden_size": int(data["hidden_size"]),
        "intermediate_size": int(data["intermediate_size"]),
        "num_hidden_layers": int(data["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(data.get("num_key_value_heads") or heads),
        "head_dim": int(data.get("head_dim") or data["hidden_size"] // heads),
        "rms_norm_eps": float(data.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(data.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(data.get("tie_word_embeddings", False)),
        "bos_token_id": data.get("bos_token_id"),
        "eos_token_ids": eos_ids(data),
    }
