"""The float64 references the quantized linear kernels are tested against.

Built independently of every kernel: GGUF blocks go through the ``gguf`` package's own
dequantizer (``gguf.quants.dequantize``, ggml's reference in numpy), int8 and int4 are
their defining formulas in float64. A reference linear is then one float64 matmul.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from hotpool.kernels.quant_interleave import deinterleave
from hotpool.kernels.quant_weight import (
    GgufKind,
    GgufWeight,
    Int8Weight,
    InterleavedWeight,
    QuantizedWeight,
)


def dequantize_reference(qw: QuantizedWeight) -> torch.Tensor:
    """The weight ``[n, k]`` in float64 on the CPU, exactly as its format defines it."""
    if isinstance(qw, InterleavedWeight):
        qw = deinterleave(qw)
    if isinstance(qw, GgufWeight):
        raw = qw.data.cpu().numpy()
        values = dequantize(raw, GGMLQuantizationType(int(qw.kind)))
        return torch.from_numpy(np.asarray(values, dtype=np.float64)).reshape(qw.shape)
    n, k = qw.shape
    if isinstance(qw, Int8Weight):
        scale = qw.scale.cpu().double().reshape(n, -1)
        per_column = scale.repeat_interleave(qw.group_size, dim=1)
        return qw.q.cpu().double() * per_column
    packed = qw.packed.cpu()
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, k).double()
    scale = qw.scale.cpu().double().repeat_interleave(qw.group_size, dim=1)
    if qw.minimum is None:
        return (q - 8) * scale
    return q * scale + qw.minimum.cpu().double().repeat_interleave(qw.group_size, dim=1)


def reference_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ deq(W).T (+ bias)`` in float64 on the CPU."""
    y = x.cpu().double() @ dequantize_reference(qw).T
    return y if bias is None else y + bias.cpu().double()


def random_gguf_bytes(n: int, k: int, kind: int, gen: torch.Generator) -> torch.Tensor:
    """Random blocks of a GGUF kind with finite, modest fp16 scales (d, and Q4_1's m or
    Q4_K's dmin, around 2**-6): test data where no quantizer is at hand (Q4_K)."""
    kind = GgufKind(kind)
    blocks = n * (k // kind.block_size)
    data = torch.randint(0, 256, (blocks, kind.block_bytes), dtype=torch.uint8, generator=gen)
    fields = 1 if kind in (GgufKind.Q8_0, GgufKind.Q4_0) else 2
    scales = (torch.rand(blocks, fields, generator=gen) * 2 - 1) * 2**-5
    data[:, : 2 * fields] = scales.half().view(torch.uint8).reshape(blocks, 2 * fields)
    return data.reshape(n, kind.row_bytes(k))
