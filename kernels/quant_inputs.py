"""The checks every quantized linear path shares: what ``x`` and ``bias`` must be for a
weight. Each failure is a ValueError that names the argument and what was expected."""

from __future__ import annotations

import torch

from hotpool.kernels.quant_weight import (
    GgufWeight,
    Int4Weight,
    Int8Weight,
    InterleavedWeight,
    QuantizedWeight,
)

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def check_linear_inputs(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """Raises ValueError unless ``x`` is ``[m, k]`` float32/bfloat16 with contiguous rows
    (rows may be strided) on the weight's device and ``bias`` is ``[n]`` floating point
    there; returns the bias as contiguous float32 (or None)."""
    if not isinstance(qw, Int8Weight | GgufWeight | InterleavedWeight | Int4Weight):
        raise ValueError(f"qw must be a quantized weight, got {type(qw).__name__}")
    n, k = qw.shape
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D [m, {k}] tensor, got {shape}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the weight takes k = {k}")
    if (x.shape[0] > 1 and x.stride(0) < k) or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x rows must be contiguous, got strides {x.stride()}")
    if x.device != qw.device:
        raise ValueError(f"x is on {x.device}, the weight on {qw.device}")
    if bias is None:
        return None
    if bias.shape != (n,) or not bias.is_floating_point():
        got = f"{bias.dtype} {list(bias.shape)}"
        raise ValueError(f"bias must be a floating-point [{n}] tensor, got {got}")
    if bias.device != qw.device:
        raise ValueError(f"bias is on {bias.device}, the weight on {qw.device}")
    return bias.to(torch.float32).contiguous()
