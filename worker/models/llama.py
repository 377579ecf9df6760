"""Llama-family decoder in plain PyTorch: Llama 2/3, SmolLM2, Mistral (full attention), Qwen2.

The families differ only in config: GQA head counts, q/k/v (and o, MLP) biases, RoPE
scaling, tied embeddings.

Tensors and positions are passed explicitly and attention goes through an
:class:`~hotpool.worker.models.attention.Attention` backend, so the same model runs over a
contiguous cache today and a paged one later. Inputs are flat: ``[num_tokens]`` ids and
positions for whatever sequences the backend's metadata describes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hotpool.worker.models.attention import Attention
from hotpool.worker.models.ops import RopeInputs, TorchOps, ops_for
from hotpool.worker.models.rope import RopeScaling, RotaryEmbedding, apply_rope, parse_rope

__all__ = ["LlamaConfig", "LlamaModel", "RotaryEmbedding", "apply_rope", "convert_hf_state_dict"]


@dataclass(frozen=True)
class LlamaConfig:
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

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> LlamaConfig:
        """Parse a HF ``config.json``; ValueError names what this model cannot run."""
        heads = int(data["num_attention_heads"])
        eos = data.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        max_positions = int(data.get("max_position_embeddings", 2048))
        _check_full_attention(data, max_positions)
        if data.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {data['hidden_act']!r} is not supported (silu)")
        theta, scaling = parse_rope(data)
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four.
        qwen2 = data.get("model_type") == "qwen2" or data.get("architectures") == [
            "Qwen2ForCausalLM"
        ]
        attention_bias = bool(data.get("attention_bias", False))
        return cls(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_hidden_layers=int(data["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_scaling=scaling,
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(data.get("mlp_bias", False)),
        )

    @classmethod
    def from_file(cls, path: Path) -> LlamaConfig:
        return cls.from_hf(json.loads(path.read_text()))


def _check_full_attention(data: dict[str, Any], max_positions: int) -> None:
    """Reject sliding-window attention: the attention backends attend over the whole context.

    A window at least as long as the context is full attention (Mistral v0.2+ sets none;
    Qwen2 configs carry a window that only counts with ``use_sliding_window``).
    """
    window = data.get("sliding_window") if data.get("use_sliding_window", True) else None
    if window is not None and int(window) < max_positions:
        raise ValueError(
            f"sliding-window attention (sliding_window={window} < max_position_embeddings="
            f"{max_positions}) is not supported yet"
        )


class RMSNorm(nn.Module):
    """Holds the weight; the model applies it through its ops (fused with the residual add)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        # One fused q/k/v matmul instead of three (PERF_NOTES: fused projections pay).
        self.wqkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self, x: torch.Tensor, rope: RopeInputs, attn: Attention, ops: TorchOps
    ) -> torch.Tensor:
        t, nq, nkv = x.shape[0], self.n_heads, self.n_kv
        qkv = self.wqkv(x).view(t, nq + 2 * nkv, self.head_dim)
        # q and k sit side by side in the fused projection: one RoPE pass for both.
        ops.rope_(qkv, nq + nkv, rope)
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
        out = attn.forward(self.layer_idx, q, k, v)
        return self.wo(out.reshape(t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        # gate and up in one matmul: [gate | up].
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        # A packed gate/up projection applies the activation itself (same bits as the native
        # silu_mul); torch ops keep their own silu for the reference path.
        fused = getattr(self.w13, "silu_mul", None)
        if fused is not None and ops.name == "native":
            return self.w2(fused(x))
        return self.w2(ops.silu_mul(self.w13(x)))


class Block(nn.Module):
    """One decoder layer's modules; :meth:`LlamaModel.forward` chains them, so that each
    residual add is fused with the RMSNorm after it."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = SelfAttention(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)


class LlamaModel(nn.Module):
    """Decoder stack; :meth:`forward` returns hidden states, :meth:`logits` projects a subset.

    ``native_ops`` (default on) lets bfloat16 on the CPU run the fused C kernels of
    :mod:`hotpool.worker.models.ops`; off, every device and dtype runs torch ops.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = rotary_for(cfg)
        self.native_ops = True
        self._ops: dict[tuple[torch.device, torch.dtype, bool], TorchOps] = {}

    def ops(self, x: torch.Tensor) -> TorchOps:
        key = (x.device, x.dtype, self.native_ops)
        found = self._ops.get(key)
        if found is None:
            found = self._ops[key] = (
                ops_for(x.device, x.dtype, self.config.head_dim) if self.native_ops else TorchOps()
            )
        return found

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        residual = self.embed(input_ids)  # a fresh tensor: the residual stream, updated in place
        ops = self.ops(residual)
        rope = ops.rope_inputs(self.rope, positions, residual.dtype)
        layers = list(self.layers)
        if not layers:
            return residual
        norm = layers[0].attention_norm
        h = ops.add_rms_norm(None, residual, norm.weight, norm.eps)
        for i, layer in enumerate(layers):
            a = layer.attention(h, rope, attn, ops)
            h = ops.add_rms_norm(a, residual, layer.ffn_norm.weight, layer.ffn_norm.eps)
            m = layer.feed_forward(h, ops)
            if i + 1 < len(layers):
                norm = layers[i + 1].attention_norm
                h = ops.add_rms_norm(m, residual, norm.weight, norm.eps)
            else:
                residual.add_(m)  # the final norm runs in logits(), on the sampled rows only
        return residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the given rows of hidden state (only the rows being sampled)."""
        return self.lm_head(self.norm(hidden)).float()


def rotary_for(cfg: LlamaConfig) -> RotaryEmbedding:
    return RotaryEmbedding(
        cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
    )


def _layer_parts(cfg: LlamaConfig) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Our per-layer modules -> (the HF modules concatenated into each, whether it has a bias)."""
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    return {
        "attention_norm": (("input_layernorm",), False),
        "ffn_norm": (("post_attention_layernorm",), False),
        "attention.wqkv": (qkv, cfg.qkv_bias),
        "attention.wo": (("self_attn.o_proj",), cfg.o_bias),
        "feed_forward.w13": (("mlp.gate_proj", "mlp.up_proj"), cfg.mlp_bias),
        "feed_forward.w2": (("mlp.down_proj",), cfg.mlp_bias),
    }


def convert_hf_state_dict(hf: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Map a HF Llama/Mistral/Qwen2 state dict onto :class:`LlamaModel`.

    q/k/v and gate/up are fused (weights and biases alike). KeyError names a tensor the
    config needs and the checkpoint lacks; ValueError lists tensors the config leaves unused
    (say, biases under ``attention_bias: false``), which would otherwise be dropped silently.
    """
    embed = hf["model.embed_tokens.weight"]
    used = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    # Tied checkpoints usually omit lm_head; when one stores it anyway, tying still wins.
    lm_head = embed if cfg.tie_word_embeddings else hf.get("lm_head.weight", embed)
    out = {"embed.weight": embed, "norm.weight": hf["model.norm.weight"], "lm_head.weight": lm_head}
    for i in range(cfg.num_hidden_layers):
        for ours, (sources, has_bias) in _layer_parts(cfg).items():
            for kind in ("weight", "bias") if has_bias else ("weight",):
                names = [f"model.layers.{i}.{src}.{kind}" for src in sources]
                used.update(names)
                parts = [hf[n] for n in names]
                out[f"layers.{i}.{ours}.{kind}"] = parts[0] if len(parts) == 1 else torch.cat(parts)
    # Old checkpoints saved the rotary tables; they are recomputed from the config.
    unused = sorted(n for n in hf if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"checkpoint has tensors this config does not use: {unused[:4]}")
    return out
