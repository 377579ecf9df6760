"""Rotary position embeddings: HF's half-rotation layout, with Llama 3, linear and LongRoPE
scaling.

The frequencies are computed exactly as HF transformers' ``modeling_rope_utils`` does, so a
checkpoint's ``rope_scaling`` (or transformers v5's ``rope_parameters``) means the same here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """A config's RoPE scaling; ``low/high_freq_factor`` are llama3's, the factor lists and
    ``attention_factor`` LongRoPE's (Phi-3), the original length both's."""

    rope_type: str  # "linear", "llama3" or "longrope"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # LongRoPE multiplies cos and sin by it


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
    return parse_rope_parameters(params, data)


def parse_rope_parameters(
    params: dict[str, Any], data: dict[str, Any], default_theta: float = 10000.0
) -> tuple[float, RopeScaling | None]:
    """One set of rope parameters (``rope_type``, ``rope_theta``, scaling fields); ``data``
    is the whole config, for the fields a v4 config keeps beside them."""
    theta = float(params.get("rope_theta", data.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # Phi-3's first name for LongRoPE
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (have {', '.join(ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    max_positions = int(data.get("max_position_embeddings", 8192))
    # HF falls back to the model's context length when the key is absent.
    original = int(
        params.get("original_max_position_embeddings")
        or data.get("original_max_position_embeddings")
        or max_positions
    )
    try:
        if rope_type == "longrope":
            return theta, _longrope(params, max_positions, original)
        factor = float(params["factor"])
        if rope_type == "linear":
            return theta, RopeScaling("linear", factor)
        return theta, RopeScaling(
            "llama3",
            factor,
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            original,
        )
    except KeyError as exc:
        raise ValueError(f"{rope_type} rope scaling lacks {exc.args[0]!r}") from None


def _longrope(params: dict[str, Any], max_positions: int, original: int) -> RopeScaling:
    # As HF: without an explicit factor, Phi-3's is the ratio of its context lengths, and
    # the attention factor follows from it (sqrt(1 + ln s / ln L) of the LongRoPE paper).
    factor = float(params.get("factor") or max_positions / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        "longrope",
        factor,
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        attention_factor=float(attention),
    )


def inv_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, long: bool = False
) -> torch.Tensor:
    """One inverse frequency per rotated pair, ``[head_dim // 2]`` in fp32 (for LongRoPE,
    ``long`` picks the factors of positions past the original context)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "longrope":
        factors = scaling.long_factor if long else scaling.short_factor
        if len(factors) != head_dim // 2:
            raise ValueError(f"longrope has {len(factors)} factors for head_dim {head_dim}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
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
    """cos/sin tables for every position, computed once in fp32.

    LongRoPE's two factor sets are one table: positions inside the original context use the
    short factors, positions past it the long ones. HF switches a whole sequence (and vLLM a
    whole batch) to the long factors once any position passes the original length; a table
    per position keeps a token's rotation the same whatever it is batched with, and equals
    HF's wherever a sequence stays inside the original context.
    """

    def __init__(
        self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None = None
    ) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_frequencies(head_dim, theta, scaling))
        if scaling is not None and scaling.rope_type == "longrope":
            long = positions >= scaling.original_max_position_embeddings
            long_inv = inv_frequencies(head_dim, theta, scaling, long=True)
            # where(), not a masked store: the model is first built on the meta device.
            freqs = torch.where(long[:, None], torch.outer(positions, long_inv), freqs)
        emb = torch.cat([freqs, freqs], dim=-1)
        # sin with the sign of rotate_half folded in, so applying RoPE is roll + two fused ops.
        signed = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
        cos = emb.cos()
        if scaling is not None and scaling.attention_factor != 1.0:
            cos, signed = cos * scaling.attention_factor, signed * scaling.attention_factor
        self.register_buffer("cos", cos, persistent=False)
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
