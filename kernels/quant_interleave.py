"""GGUF Q8_0 / Q4_0 / Q4_1 weights to and from the interleaved layout of
:class:`~hotpool.kernels.quant_weight.InterleavedWeight`, once at load.

Why: a decode step reads each weight once, so the CPU kernel must keep up with the memory
bus. Row by row, each 32-weight block costs its own scale conversion, broadcast and
horizontal bookkeeping; with 16 output features' blocks side by side, one instruction
converts 16 scales, the integers of a column pair for 16 features widen into one vector,
and every multiply-add serves 16 outputs. The AMX path reads the same bytes as its
weight tiles (VNNI order: a column pair per feature). Same bytes, reordered: the file's
blocks are served as they are, not dequantized.
"""

from __future__ import annotations

import torch

from hotpool.kernels.quant_weight import (
    INTERLEAVE,
    INTERLEAVED_KINDS,
    GgufKind,
    GgufWeight,
    InterleavedWeight,
)


def _header_bytes(kind: GgufKind) -> int:
    return 4 if kind is GgufKind.Q4_1 else 2


def interleave(qw: GgufWeight) -> InterleavedWeight:
    """``qw`` (Q8_0, Q4_0 or Q4_1) in 16-feature groups; ValueError for other kinds."""
    if qw.kind not in INTERLEAVED_KINDS:
        kinds = [k.name for k in INTERLEAVED_KINDS]
        raise ValueError(f"{qw.kind.name} does not interleave (only {kinds})")
    n, k = qw.shape
    nb, bs, hb = k // 32, qw.kind.block_bytes, _header_bytes(qw.kind)
    groups = -(-n // INTERLEAVE)
    rows = torch.zeros(groups * INTERLEAVE, nb, bs, dtype=torch.uint8, device=qw.device)
    rows[:n] = qw.data.reshape(n, nb, bs)
    blocks = rows.reshape(groups, INTERLEAVE, nb, bs).transpose(1, 2)  # [g, b, f, bytes]
    # headers: the 16 features' d (then m), each field contiguous: [g, b, field, f, 2]
    heads = blocks[..., :hb].reshape(groups, nb, INTERLEAVE, hb // 2, 2).transpose(2, 3)
    quants = blocks[..., hb:]
    if qw.kind is GgufKind.Q8_0:
        # [g, b, f, p, 2] -> [g, b, p, f, 2]
        q = quants.reshape(groups, nb, INTERLEAVE, 16, 2).transpose(2, 3)
    else:
        # byte i of a block holds column i (low nibble) and i + 16 (high): columns first,
        # then column pairs (2 p, 2 p + 1) as one byte, [g, b, p, f]
        cols = torch.cat([quants & 0xF, quants >> 4], dim=-1).reshape(groups, nb, INTERLEAVE, 16, 2)
        q = (cols[..., 0] | (cols[..., 1] << 4)).transpose(2, 3)
    out = torch.cat([heads.reshape(groups, nb, -1), q.reshape(groups, nb, -1)], dim=-1).reshape(
        groups, -1
    )
    return InterleavedWeight(qw.kind, out.contiguous(), qw.shape)


def deinterleave(iw: InterleavedWeight) -> GgufWeight:
    """The GgufWeight ``iw`` was made from (what references, the torch path and GPUs read)."""
    n, k = iw.shape
    kind, nb = iw.kind, k // 32
    bs, hb = kind.block_bytes, _header_bytes(kind)
    groups = iw.data.shape[0]
    per = iw.data.reshape(groups, nb, INTERLEAVE * bs)
    heads = per[..., : INTERLEAVE * hb].reshape(groups, nb, hb // 2, INTERLEAVE, 2)
    heads = heads.transpose(2, 3).reshape(groups, nb, INTERLEAVE, hb)
    q = per[..., INTERLEAVE * hb :]
    if kind is GgufKind.Q8_0:
        quants = (
            q.reshape(groups, nb, 16, INTERLEAVE, 2)
            .transpose(2, 3)
            .reshape(groups, nb, INTERLEAVE, 32)
        )
    else:
        pairs = q.reshape(groups, nb, 16, INTERLEAVE).transpose(2, 3)  # [g, b, f, p]
        cols = torch.stack([pairs & 0xF, pairs >> 4], dim=-1).reshape(groups, nb, INTERLEAVE, 32)
        quants = cols[..., :16] | (cols[..., 16:] << 4)
    blocks = torch.cat([heads, quants], dim=-1)  # [g, b, f, bs]
    rows = blocks.transpose(1, 2).reshape(groups * INTERLEAVE, nb * bs)[:n]
    return GgufWeight(kind, rows.contiguous(), iw.shape)
