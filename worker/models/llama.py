"""The decoder every family runs on: the Llama block, with the switches of
:class:`~hotpool.worker.models.config.ModelConfig` (QK-norm, sandwich norms, GeGLU, a scaled
embedding, sliding-window layers with their own RoPE, soft-capped logits, a MoE MLP).

Llama 2/3, SmolLM2, Mistral and Qwen2 are the block as it is; Qwen3, Qwen3-MoE, Phi-3 and
Gemma 3 are its switches (:mod:`hotpool.worker.models.families`).

Tensors and positions are passed explicitly and attention goes through an
:class:`~hotpool.worker.models.attention.Attention` backend, so the same model runs over a
contiguous cache and a paged one. Inputs are flat: ``[num_tokens]`` ids and positions for
whatever sequences the backend's metadata describes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hotpool.worker.models.attention import Attention
from hotpool.worker.models.config import ModelConfig
from hotpool.worker.models.moe import SparseMoE
from hotpool.worker.models.ops import RopeInputs, TorchOps, ops_for
from hotpool.worker.models.rope import RotaryEmbedding, apply_rope
from hotpool.worker.models.weights import convert_hf_state_dict

__all__ = ["LlamaModel", "ModelConfig", "RotaryEmbedding", "apply_rope", "convert_hf_state_dict"]


class RMSNorm(nn.Module):
    """Holds the weight; the model applies it through its ops (fused with the residual add)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.layer_window(layer_idx)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        # One fused q/k/v matmul instead of three (PERF_NOTES: fused projections pay).
        self.wqkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # The kernels scale scores by head_dim ** -0.5; a model with a scale of its own
        # (Gemma) has the ratio folded into its queries, so every kernel serves it.
        scale = cfg.attention_scale
        self.q_scale = None if scale is None else scale * cfg.head_dim**0.5
        if self.q_scale == 1.0:
            self.q_scale = None

    def forward(
        self, x: torch.Tensor, rope: RopeInputs, attn: Attention, ops: TorchOps
    ) -> torch.Tensor:
        t, nq, nkv = x.shape[0], self.n_heads, self.n_kv
        qkv = self.wqkv(x).view(t, nq + 2 * nkv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qkv[:, :nq] = ops.rms_norm(qkv[:, :nq], self.q_norm.weight, self.q_norm.eps)
            qkv[:, nq : nq + nkv] = ops.rms_norm(
                qkv[:, nq : nq + nkv], self.k_norm.weight, self.k_norm.eps
            )
        # q and k sit side by side in the fused projection: one RoPE pass for both.
        ops.rope_(qkv, nq + nkv, rope)
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
        if self.q_scale is not None:
            q = q * self.q_scale
        out = attn.forward(self.layer_idx, q, k, v, window=self.window)
        return self.wo(out.reshape(t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up in one matmul: [gate | up].
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.activation = cfg.activation

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        if self.activation == "gelu_tanh":
            return self.w2(ops.gelu_tanh_mul(self.w13(x)))
        # A packed gate/up projection applies the activation itself (same bits as the native
        # silu_mul); torch ops keep their own silu for the reference path.
        fused = getattr(self.w13, "silu_mul", None)
        if fused is not None and ops.name == "native":
            return self.w2(fused(x))
        return self.w2(ops.silu_mul(self.w13(x)))


class MoEFeedForward(SparseMoE):
    """A sparse layer's MLP, called as :class:`FeedForward` is."""

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.moe is None:
            raise ValueError("a MoE layer needs the config's moe section")
        super().__init__(cfg.hidden_size, cfg.moe)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, ops.silu_mul)


class Block(nn.Module):
    """One decoder layer's modules; :meth:`LlamaModel.forward` chains them, so that each
    residual add is fused with the RMSNorm after it."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.attention_norm = RMSNorm(cfg.hidden_size, eps)
        self.attention = SelfAttention(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.hidden_size, eps)
        sparse = cfg.moe is not None and cfg.moe.layers[layer_idx]
        self.feed_forward: FeedForward | MoEFeedForward = (
            MoEFeedForward(cfg) if sparse else FeedForward(cfg)
        )
        # Gemma's sandwich: each sublayer's output is normed before the residual add.
        self.post_attention_norm = RMSNorm(cfg.hidden_size, eps) if cfg.sandwich_norms else None
        self.post_ffn_norm = RMSNorm(cfg.hidden_size, eps) if cfg.sandwich_norms else None
        self.local_rope = cfg.layer_window(layer_idx) is not None


class LlamaModel(nn.Module):
    """Decoder stack; :meth:`forward` returns hidden states, :meth:`logits` projects a subset.

    ``native_ops`` (default on) lets bfloat16 on the CPU run the fused C kernels of
    :mod:`hotpool.worker.models.ops`; off, every device and dtype runs torch ops.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = rotary_for(cfg)
        # The sliding layers' own RoPE (Gemma 3), None where they share the global one.
        self.local_rope = local_rotary_for(cfg)
        self.native_ops = True
        # What load_model's quantization did (a quantize.QuantizationReport), None if none.
        self.quantization: object | None = None
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
        ops = self.ops(self.embed.weight)
        # A fresh tensor: the residual stream, updated in place.
        residual = ops.embed(self.embed.weight, input_ids)
        if self.config.embed_scale is not None:
            # As HF: the scale rounded to the embeddings' dtype, then multiplied in it.
            residual.mul_(torch.tensor(self.config.embed_scale, dtype=residual.dtype))
        rope = ops.rope_inputs(self.rope, positions, residual.dtype)
        local = rope
        if self.local_rope is not None:
            local = ops.rope_inputs(self.local_rope, positions, residual.dtype)
        layers = list(self.layers)
        if not layers:
            return residual
        norm = layers[0].attention_norm
        h = ops.add_rms_norm(None, residual, norm.weight, norm.eps)
        for i, layer in enumerate(layers):
            a = layer.attention(h, local if layer.local_rope else rope, attn, ops)
            if layer.post_attention_norm is not None:
                a = ops.rms_norm(a, layer.post_attention_norm.weight, layer.post_attention_norm.eps)
            h = ops.add_rms_norm(a, residual, layer.ffn_norm.weight, layer.ffn_norm.eps)
            m = layer.feed_forward(h, ops)
            if layer.post_ffn_norm is not None:
                m = ops.rms_norm(m, layer.post_ffn_norm.weight, layer.post_ffn_norm.eps)
            if i + 1 < len(layers):
                norm = layers[i + 1].attention_norm
                h = ops.add_rms_norm(m, residual, norm.weight, norm.eps)
            else:
                ops.add_(residual, m)  # the final norm runs in logits(), on the sampled rows
        return residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the given rows of hidden state (only the rows being sampled)."""
        ops = self.ops(hidden)
        logits = ops.widen(self.lm_head(ops.rms_norm(hidden, self.norm.weight, self.norm.eps)))
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def rotary_for(cfg: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(
        cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
    )


def local_rotary_for(cfg: ModelConfig) -> RotaryEmbedding | None:
    if cfg.local_rope_theta is None or not any(cfg.layer_sliding):
        return None
    return RotaryEmbedding(
        cfg.head_dim, cfg.local_rope_theta, cfg.max_position_embeddings, cfg.local_rope_scaling
    )
