"""What each llama.cpp architecture is in HF transformers: its config.json and tensor names.

One :class:`Family` per ``general.architecture``, written as data plus one small function for
the config fields only that family has. Each mirrors what HF transformers does when it loads a
GGUF of that family (``GGUF_CONFIG_MAPPING`` in ``integrations/ggml.py`` and the tensor
processors of ``modeling_gguf_pytorch_utils.py``), except where noted: there HF is wrong for
some checkpoints and we follow llama.cpp, which ran the model that was quantized.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hotpool.worker.snapshot.errors import SnapshotError

Meta = Mapping[str, Any]
_HF_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_REQUIRED = object()


@dataclass(frozen=True)
class ArchMeta:
    """A GGUF's metadata under its architecture's prefix: ``key("block_count")`` reads
    ``gemma3.block_count``; a missing key without a default is a :class:`SnapshotError`.
    ``tensors``: the values of the family's ``config_tensors`` the file holds."""

    meta: Meta
    arch: str
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __call__(self, name: str, default: Any = _REQUIRED) -> Any:
        full = f"{self.arch}.{name}"
        if full in self.meta:
            return self.meta[full]
        if default is _REQUIRED:
            raise SnapshotError(f"GGUF metadata lacks {full!r}")
        return default


@dataclass(frozen=True)
class Family:
    """How one llama.cpp architecture maps onto its HF transformers model.

    ``block_names`` maps the part of ``blk.N.<part>.weight`` to the HF module under
    ``model.layers.N``; ``config`` returns the config fields of this family only.
    ``permute_qk``: llama.cpp reordered q/k rows for its rotary layout (Llama only).
    ``norm_offset``: llama.cpp stores Gemma's RMSNorm weights as ``1 + w``.
    ``sentencepiece``: which HF tokenizer a SentencePiece vocabulary of this family becomes
    (``gemma``, ``llama`` or ``phi3``).
    ``config_tensors``: GGUF tensors that are config values, not weights (Phi-3's LongRoPE
    factors); ``config`` reads them from :attr:`ArchMeta.tensors`.
    A block name holding ``{e}`` is a stack of experts ``[experts, out, in]``: one HF tensor
    per expert.
    """

    hf_architecture: str
    model_type: str
    block_names: Mapping[str, str]
    config: Callable[[ArchMeta], dict[str, Any]]
    permute_qk: bool = False
    norm_offset: float = 0.0
    sentencepiece: str = "llama"
    config_tensors: frozenset[str] = frozenset()


_LLAMA_BLOCKS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 3 norms both sides of attention and of the MLP; llama.cpp's ffn_norm is the one
# *before* the MLP, which Llama calls post_attention_layernorm.
_GEMMA3_BLOCKS = {
    **_LLAMA_BLOCKS,
    **_QK_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 as llama.cpp's converter writes it: HF's fused q/k/v and gate/up kept as they are
# (``ffn_up`` is HF's ``gate_up_proj``, gate rows first), and nothing permuted (NeoX rotary).
_PHI3_BLOCKS = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Qwen3-MoE: Qwen3's attention; in place of the MLP a router (``ffn_gate_inp``) and each
# expert's matrices stacked in one tensor, which HF stores per expert.
_QWEN3MOE_BLOCKS = {
    **{k: v for k, v in _LLAMA_BLOCKS.items() if k not in ("ffn_gate", "ffn_up", "ffn_down")},
    **_QK_NORMS,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
# llama.cpp hard-codes Gemma 3's attention layout rather than storing it: every sixth layer
# attends globally, and sliding layers use rope base 10000 (HF's rope_local_base_freq).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62


def f32(value: float) -> float:
    """The shortest decimal of a float32 GGUF value: 1e-06, not 9.999999974752427e-07."""
    return float(str(np.float32(value)))


def _llama(key: ArchMeta) -> dict[str, Any]:
    heads = int(key("attention.head_count"))
    return {
        "head_dim": int(key("rope.dimension_count", int(key("embedding_length")) // heads)),
        "hidden_act": "silu",
        "rope_theta": f32(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(key),
        "attention_bias": False,
        "mlp_bias": False,
    }


def _qwen2(key: ArchMeta) -> dict[str, Any]:
    # Qwen2's q/k/v carry biases by construction; its config has no field for them.
    return {
        "hidden_act": "silu",
        "rope_theta": f32(key("rope.freq_base", 1000000.0)),
        "rope_scaling": _rope_scaling(key),
        "use_sliding_window": False,
    }


def _qwen3(key: ArchMeta) -> dict[str, Any]:
    # HF's GGUF loader leaves head_dim at Qwen3Config's default (128, right for every Qwen3
    # released); the file states it, and hidden / heads is not it (Qwen3-0.6B: 1024 / 16).
    return {**_qwen2(key), "head_dim": int(key("attention.key_length")), "attention_bias": False}


def _qwen3moe(key: ArchMeta) -> dict[str, Any]:
    # llama.cpp's qwen3moe routes every layer (no dense ones) and always renormalizes the
    # top-k weights (HF's GGUF loader sets norm_topk_prob too). HF's loader keeps
    # Qwen3MoeConfig's moe_intermediate_size (768); the file states it.
    return {
        **_qwen3(key),
        "num_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _phi3(key: ArchMeta) -> dict[str, Any]:
    # Phi3Config has no head_dim: it is hidden / heads. llama.cpp's converter writes the
    # rotary width as rope.dimension_count (Phi-4-mini rotates 3/4 of each head).
    head_dim = int(key("embedding_length")) // int(key("attention.head_count"))
    if int(key("attention.key_length", head_dim)) != head_dim:
        raise SnapshotError(f"phi3 heads of {key('attention.key_length')} != hidden / heads")
    rotary = int(key("rope.dimension_count", head_dim))
    original = int(key("rope.scaling.original_context_length", key("context_length")))
    config: dict[str, Any] = {
        "hidden_act": "silu",
        "rope_theta": f32(key("rope.freq_base", 10000.0)),
        "rope_scaling": _longrope(key, original, rotary),
        "original_max_position_embeddings": original,
        # The converter writes Phi-3's sliding window, which llama.cpp then ignores ("Phi SWA
        # is currently disabled", llama.cpp#13676), as HF's GGUF loader does.
        "sliding_window": None,
    }
    if rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    return config


def _longrope(key: ArchMeta, original: int, rotary: int) -> dict[str, Any] | None:
    """Phi-3's LongRoPE: llama.cpp's converter writes the factors as tensors, not metadata,
    and no ``rope.scaling.type``; HF's GGUF loader drops them (plain RoPE). llama.cpp divides
    each rotated pair's frequency by its factor, as HF's ``longrope`` does (HF takes the long
    factors for a sequence past ``original``, llama.cpp for a context window past it), and
    scales cos/sin by ``rope.scaling.attn_factor``."""
    kind = key("rope.scaling.type", "none")
    found = [name for name in _LONGROPE_FACTORS if name in key.tensors]
    if not found and kind == "none":
        return None
    if kind not in ("none", "longrope") or len(found) != len(_LONGROPE_FACTORS):
        raise SnapshotError(
            f"phi3 rope scaling {kind!r} with factor tensors {found} is not supported "
            "(LongRoPE needs rope_factors_long and _short)"
        )
    long, short = (key.tensors[name].reshape(-1) for name in _LONGROPE_FACTORS)
    if len(long) != rotary // 2 or len(short) != rotary // 2:
        raise SnapshotError(f"LongRoPE has {len(long)}/{len(short)} factors for {rotary} dims")
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": [f32(f) for f in long],
        "short_factor": [f32(f) for f in short],
    }
    # HF derives the attention factor from the context lengths, as llama.cpp's converter
    # did when it wrote it; a file that says otherwise is followed.
    scale = int(key("context_length")) / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    stored = key("rope.scaling.attn_factor", None)
    if stored is not None and np.float32(stored) != np.float32(derived):
        scaling["attention_factor"] = f32(stored)
    return scaling


def _gemma3(key: ArchMeta) -> dict[str, Any]:
    layers = int(key("block_count"))
    head_dim = int(key("attention.key_length"))
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B model (62 layers),
    # which uses hidden / heads; HF's loader always takes its default of 256.
    scalar = head_dim
    if layers == _GEMMA3_27B_LAYERS:
        scalar = int(key("embedding_length")) // int(key("attention.head_count"))
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(key("attention.sliding_window")),
        "_sliding_window_pattern": _GEMMA3_PATTERN,
        "layer_types": [
            "full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "rope_theta": f32(key("rope.freq_base", 1000000.0)),
        "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE,
        "rope_scaling": _rope_scaling(key),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", _LLAMA_BLOCKS, _llama, permute_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", _LLAMA_BLOCKS, _qwen2),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", {**_LLAMA_BLOCKS, **_QK_NORMS}, _qwen3),
    "qwen3moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", _QWEN3MOE_BLOCKS, _qwen3moe),
    "phi3": Family(
        "Phi3ForCausalLM",
        "phi3",
        _PHI3_BLOCKS,
        _phi3,
        sentencepiece="phi3",
        config_tensors=frozenset(_LONGROPE_FACTORS),
    ),
    "gemma3": Family(
        "Gemma3ForCausalLM",
        "gemma3_text",
        _GEMMA3_BLOCKS,
        _gemma3,
        norm_offset=1.0,
        sentencepiece="gemma",
    ),
}


def family_of(meta: Meta) -> tuple[str, Family]:
    """The GGUF's architecture name and its :class:`Family`; a clear error for others."""
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise SnapshotError(f"architecture {arch!r} is not supported ({', '.join(FAMILIES)})")
    return str(arch), FAMILIES[arch]


def hf_config(
    meta: Meta,
    tensor_names: set[str],
    dtype: str,
    config_tensors: Mapping[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """The HF ``config.json`` of the GGUF model described by ``meta``; ``config_tensors``
    holds the values of the family's :attr:`Family.config_tensors` in the file."""
    arch, family = family_of(meta)
    key = ArchMeta(meta, arch, config_tensors or {})
    heads = int(key("attention.head_count"))
    if "tokenizer.ggml.tokens" not in meta:
        raise SnapshotError("GGUF metadata lacks 'tokenizer.ggml.tokens'")
    config = {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "rms_norm_eps": f32(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(key("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        # llama.cpp writes output.weight only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": _HF_DTYPE_NAMES[dtype],
    }
    return config | family.config(key)


def _rope_scaling(key: ArchMeta) -> dict[str, Any] | None:
    """HF's ``rope_scaling`` for the GGUF's ``rope.scaling.*``: none, or linear."""
    kind = key("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": f32(key("rope.scaling.factor"))}
    raise SnapshotError(f"rope scaling {kind!r} is not supported yet (none, linear)")
