"""What each llama.cpp architecture is in HF transformers: its config.json and tensor names.

One :class:`Family` per ``general.architecture``, written as data plus one small function for
the config fields only that family has. Each mirrors what HF transformers does when it loads a
GGUF of that family (``GGUF_CONFIG_MAPPING`` in ``integrations/ggml.py`` and the tensor
processors of ``modeling_gguf_pytorch_utils.py``), except where noted: there HF is wrong for
some checkpoints and we follow llama.cpp, which ran the model that was quantized.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hotpool.worker.snapshot.errors import SnapshotError

Meta = Mapping[str, Any]
_HF_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_REQUIRED = object()


@dataclass(frozen=True)
class ArchMeta:
    """A GGUF's metadata under its architecture's prefix: ``key("block_count")`` reads
    ``gemma3.block_count``; a missing key without a default is a :class:`SnapshotError`."""

    meta: Meta
    arch: str

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
    (``gemma`` or ``llama``).
    """

    hf_architecture: str
    model_type: str
    block_names: Mapping[str, str]
    config: Callable[[ArchMeta], dict[str, Any]]
    permute_qk: bool = False
    norm_offset: float = 0.0
    sentencepiece: str = "llama"


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


def hf_config(meta: Meta, tensor_names: set[str], dtype: str) -> dict[str, Any]:
    """The HF ``config.json`` of the GGUF model described by ``meta``."""
    arch, family = family_of(meta)
    key = ArchMeta(meta, arch)
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
