"""Quantized weights and the closeness check the quantized linear tests share."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from hotpool.kernels.quant_reference import (
    dequantize_reference,
    random_gguf_bytes,
    reference_linear,
)
from hotpool.kernels.quant_weight import (
    GgufKind,
    GgufWeight,
    Int8Weight,
    QuantizedWeight,
    from_gguf_bytes,
    quantize_int8,
)

# What the C kernels serve: int8 per output feature and GGUF's blocks.
CPU_FORMATS = ("int8", "Q8_0", "Q4_0", "Q4_1", "Q4_K")
FP32_RTOL = 1e-4  # of |x_i| |w_j|: float32 sums in another order
BF16_STEP = 2**-8  # relative: a bfloat16 output is rounded once (half a step is 2**-9)


def make_weight(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """A weight ``[n, k]`` in ``fmt``: quantized from a random matrix (gguf's quantizers for
    Q8_0 / Q4_0 / Q4_1), or random Q4_K blocks (gguf has no Q4_K quantizer)."""
    if fmt == "Q4_K":
        return GgufWeight(GgufKind.Q4_K, random_gguf_bytes(n, k, GgufKind.Q4_K, gen), (n, k))
    w = torch.randn(n, k, generator=gen) * 0.1
    if fmt == "int8":
        return Int8Weight(*quantize_int8(w))
    return from_gguf_bytes(fmt, quantize(w.numpy(), GGMLQuantizationType[fmt]), (n, k))


def block_k(fmt: str) -> int:
    """The smallest k a format takes."""
    return 256 if fmt == "Q4_K" else 32


def assert_matches_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    qw: QuantizedWeight,
    bias: torch.Tensor | None = None,
    rtol: float = FP32_RTOL,
    bf16_step: float = BF16_STEP,
) -> None:
    """``y`` is ``x @ deq(W).T (+ bias)`` (float64) within ``rtol`` of ``|x_i| |w_j|`` per
    element, plus ``bf16_step`` of the value where ``y`` is bfloat16; and has x's dtype."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], qw.shape[0])
    ref = reference_linear(x, qw, bias)
    w = dequantize_reference(qw)
    bound = rtol * x.cpu().double().norm(dim=1)[:, None] * w.norm(dim=1)[None, :] + 1e-12
    if y.dtype == torch.bfloat16:
        bound = bound + bf16_step * ref.abs()
    err = (y.cpu().double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max error {err.max().item():.3g} is {worst:.2f}x the bound"
