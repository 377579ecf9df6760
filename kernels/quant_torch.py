"""Quantized weights in plain torch: dequantizing a range of rows, the fallback linear, and
the repacks of GGUF blocks into the Triton kernels' layouts.

The fallback runs where no kernel does (no C compiler, CUDA without Triton, GGUF blocks on
a GPU that were not repacked): it dequantizes ``CHUNK_ROWS`` output features at a time into
float32 and multiplies, so it never holds a float copy of the whole matrix either. It is
slower than the kernels, not different: tests hold it to the same float64 reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hotpool.kernels.quant_interleave import deinterleave
from hotpool.kernels.quant_weight import (
    GgufKind,
    GgufWeight,
    Int4Weight,
    Int8Weight,
    InterleavedWeight,
    QuantizedWeight,
    pack_nibbles,
)

CHUNK_ROWS = 4096


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte ``at`` of each block ``[..., bytes]`` as float32 ``[..., 1]``."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).float()


def _q4k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes ``[..., 12]`` -> 6-bit scales and mins ``[..., 8]`` (int32)."""
    s = s.int()
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 0xF) | ((d >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc, mn


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """GGUF's order: bytes ``[..., b]`` -> ``[..., 2 b]``, all low nibbles, then all high."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def dequantize_rows(qw: QuantizedWeight, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of the weight in float32, on the weight's device."""
    k = qw.shape[1]
    rows = stop - start
    if isinstance(qw, Int8Weight):
        scale = qw.scale[start:stop].reshape(rows, -1).repeat_interleave(qw.group_size, dim=1)
        return qw.q[start:stop].float() * scale
    if isinstance(qw, Int4Weight):
        p = qw.packed[start:stop]
        q = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(rows, k).float()
        scale = qw.scale[start:stop].repeat_interleave(qw.group_size, dim=1)
        if qw.minimum is None:
            return (q - 8) * scale
        return q * scale + qw.minimum[start:stop].repeat_interleave(qw.group_size, dim=1)
    blocks = qw.data[start:stop].reshape(rows, k // qw.kind.block_size, qw.kind.block_bytes)
    if qw.kind is GgufKind.Q8_0:
        w = blocks[..., 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)
    elif qw.kind is GgufKind.Q4_0:
        w = (_nibbles(blocks[..., 2:]).float() - 8) * _f16(blocks, 0)
    elif qw.kind is GgufKind.Q4_1:
        w = _nibbles(blocks[..., 4:]).float() * _f16(blocks, 0) + _f16(blocks, 2)
    else:
        sc, mn = _q4k_scales(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(rows, -1, 4, 32)
        q = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(rows, -1, 8, 32).float()
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        w = (d * sc.float())[..., None] * q - (dmin * mn.float())[..., None]
    return w.reshape(rows, k)


def torch_quant_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ deq(W).T (+ bias)`` in float32, returned in ``x``'s dtype (inputs checked by
    the caller, :func:`hotpool.kernels.quant_linear.quant_linear`)."""
    if isinstance(qw, InterleavedWeight):
        qw = deinterleave(qw)
    n = qw.shape[0]
    xf = x.float()
    parts = []
    for start in range(0, n, CHUNK_ROWS):
        stop = min(n, start + CHUNK_ROWS)
        b = None if bias is None else bias[start:stop].float()
        parts.append(F.linear(xf, dequantize_rows(qw, start, stop), b))
    return torch.cat(parts, dim=1).to(x.dtype)


def repack_for_triton(qw: QuantizedWeight) -> Int8Weight | Int4Weight:
    """The weight in a layout the Triton kernels read, computing the same values: Q8_0 as
    int8 with a scale per 32 columns, Q4_0 / Q4_1 / Q4_K as int4 groups of 32 (Q4_K's
    sub-block scale ``d * sc`` and minimum ``-dmin * m`` folded once, in float32). A repack,
    about the size of the blocks, never a float copy. Int8 and int4 weights pass through."""
    if isinstance(qw, InterleavedWeight):
        qw = deinterleave(qw)
    if not isinstance(qw, GgufWeight):
        return qw
    n, k = qw.shape
    blocks = qw.data.reshape(n, k // qw.kind.block_size, qw.kind.block_bytes)
    if qw.kind is GgufKind.Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return Int8Weight(q, _f16(blocks, 0).reshape(n, -1).contiguous())
    if qw.kind is GgufKind.Q4_K:
        sc, mn = _q4k_scales(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(n, -1, 4, 32)
        q = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(n, k)
        scale = (_f16(blocks, 0) * sc.float()).reshape(n, -1)
        minimum = (-(_f16(blocks, 2) * mn.float())).reshape(n, -1)
        return Int4Weight(pack_nibbles(q), scale.contiguous(), minimum.contiguous(), 32)
    at = 2 if qw.kind is GgufKind.Q4_0 else 4
    q = _nibbles(blocks[..., at:]).reshape(n, k)
    scale = _f16(blocks, 0).reshape(n, -1).contiguous()
    minimum = None if qw.kind is GgufKind.Q4_0 else _f16(blocks, 2).reshape(n, -1).contiguous()
    return Int4Weight(pack_nibbles(q), scale, minimum, 32)
