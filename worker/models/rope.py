"""Rotary position embeddings: HF's half-rotation layout, with Llama 3 and linear scaling.

The frequencies are computed exactly as HF transformers' ``modeling_rope_utils`` does, so a
checkpoint's ``rope_scaling`` (or transformers v5's ``rope_parameters``) means the same here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A config's RoPE scaling; ``low/high_freq_factor`` and the original length are llama3's."""

    rope_type: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def parse_rope(data: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from a HF config dict; ValueError for what we cannot run.

    transformers v4 writes ``rope_theta`` and ``rope_scaling``; v5 writes one
    ``rope_parameters`` dict holding both.
    """
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_scaling must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope parameters are not supported")
    theta = float(params.get("rope_theta", data.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (have {', '.join(ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    try:
        factor = float(params["factor"])
        if rope_type == "linear":
            return theta, RopeScaling("linear", factor)
        return theta, RopeScaling(
            "llama3",
            factor,
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            # HF falls back to the model's context length when the key is absent.
            int(
                params.get("original_max_position_embeddings")
                or data.get("max_position_embeddings", 8192)
            ),
        )
    except KeyError as exc:
        raise ValueError(f"{rope_type} rope scaling lacks {exc.args[0]!r}") from None


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """One inverse frequency per rotated pair, ``[head_dim // 2]`` in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":  # positions / factor, folded into the frequencies
        return inv_freq / scaling.factor
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in fp32."""

    def __init__(
        self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None = None
    ) -> None:
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        # sin with the sign of rotate_half folded in, so applying RoPE is roll + two fused ops.
        signed = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
        self.register_buffer("sin", signed, persistent=False)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and signed sin for ``positions``, ``[T, 1, D]`` so they broadcast over heads."""
        cos, sin = self.tables(dtype)
        return cos[positions, None, :], sin[positions, None, :]

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        self._cast.clear()  # moved or cast: the cached tables belong to the old device
        return super()._apply(fn, recurse)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and signed sin tables ``[max_positions, D]`` in ``dtype``."""
        tables = self._cast.get(dtype)
        if tables is None:
            # Cast the tables once per dtype instead of two casts per forward pass.
            tables = self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return tables


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's half-rotation RoPE: ``x * cos + rotate_half(x) * sin``, with ``sin`` from
    :class:`RotaryEmbedding` (signed), where ``rotate_half(x) * sin == roll(x) * signed_sin``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
