"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA) in plain PyTorch.

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

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> LlamaConfig:
        heads = int(data["num_attention_heads"])
        eos = data.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_hidden_layers=int(data["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(data.get("rope_theta", 10000.0)),
            max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: Path) -> LlamaConfig:
        return cls.from_hf(json.loads(path.read_text()))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, then scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in fp32 (HF's half-rotation layout)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # [T, 1, D] so they broadcast over heads.
        return self.cos[positions, None, :].to(dtype), self.sin[positions, None, :].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class SelfAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        # One fused q/k/v matmul instead of three (PERF_NOTES: fused projections pay).
        self.wqkv = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.wo = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = apply_rope(q.view(t, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.n_kv, self.head_dim), cos, sin)
        v = v.view(t, self.n_kv, self.head_dim)
        out = attn.forward(self.layer_idx, q, k, v)
        return self.wo(out.reshape(t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate|up
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.inter, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = SelfAttention(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, attn)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaModel(nn.Module):
    """Decoder stack; :meth:`forward` returns hidden states, :meth:`logits` projects a subset."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the given rows of hidden state (only the rows being sampled)."""
        return self.lm_head(self.norm(hidden)).float()


# HF checkpoint names -> ours. q/k/v and gate/up are fused at load time.
_RENAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}


def convert_hf_state_dict(hf: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Map a HF Llama state dict onto :class:`LlamaModel`, fusing q/k/v and gate/up."""
    out: dict[str, torch.Tensor] = {
        "embed.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "lm_head.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"]),
    }
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = hf["model.embed_tokens.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for src, dst in _RENAMES.items():
            out[f"layers.{i}.{dst}"] = hf[p + src]
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat(
            [hf[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]
        )
        out[f"layers.{i}.feed_forward.w13.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
        )
    return out
