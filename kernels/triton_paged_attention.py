"""Attention over a paged KV cache: Triton kernels (the CUDA path).

Same cache layout, signatures and results as :mod:`hotpool.kernels.paged_attention`, whose
torch functions are the references these are tested against, so the engine picks one
module or the other by device. The cache of one layer is
``[num_kv_heads, num_blocks, block_size, head_dim]``; query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``.

Both kernels keep an online softmax (running max and sum in fp32) over the key blocks a
block table lists, accumulate in fp32 and write the output in ``q``'s dtype. Products go
through ``tl.dot`` with ``input_precision="ieee"``: fp16/bf16 still use tensor cores, and
fp32 inputs stay exact instead of silently dropping to TF32.

With a sliding ``window`` the loops start at the block holding a query's first visible key:
blocks wholly before the window are never read (their table entries may hold anything), so
a layer's cost is bounded by the window, not the context. Inside the kernels ``window`` 0
stands for None (the whole causal context).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hotpool.kernels.paged_attention import check_window

# 256 is Gemma 3's. Every tile is already the smallest tl.dot takes (16 keys a step, 16 query
# rows), so D = 256 only doubles the fp32 accumulator, to 16 x 256 a program. Compiled for
# sm_90 (bf16, group 4, 4 warps, by ptxas without a GPU): decode 96 registers a thread, prefill
# 150 (D = 128: 90 and 80), no spills, 17 KB of shared memory. Not yet timed on a GPU.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (16,)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PREFILL_TILE = 16  # query tokens per prefill program; tl.dot needs every dimension >= 16
_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``UPCAST`` works around Triton's CPU interpreter, whose
    ``tl.dot`` multiplies bf16 bit patterns as integers: a bf16 product is exact in fp32, so
    upcasting first gives the tensor cores' result."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
    stride_qb, stride_qh,
    stride_kh, stride_kb, stride_ks,
    stride_vh, stride_vb, stride_vs,
    stride_tb, stride_tn, stride_lb,
    stride_ob, stride_oh,
    max_blocks, scale_log2, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, KV head): the KV head's GROUP query heads share every load
    # of its keys and values, padded to GROUP_PAD rows for tl.dot.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=(g < GROUP)[:, None],
        other=0.0,
    )
    seq_len = tl.load(lens_ptr + seq * stride_lb)
    n_blocks = tl.minimum(tl.cdiv(seq_len, BLOCK_SIZE), max_blocks)
    # The query sits at seq_len - 1: its window is the keys [first, seq_len).
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    k_base = k_ptr + kv_head * stride_kh + d[:, None] + s[None, :] * stride_ks  # [D, BS]
    v_base = v_ptr + kv_head * stride_vh + s[:, None] * stride_vs + d[None, :]  # [BS, D]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # Only the blocks holding the window's tokens are read, so padding entries of the table
    # never are. The first block holds key `first`, so every row's max is finite from it on.
    for j in range(first // BLOCK_SIZE, n_blocks):
        block = tl.load(tables_ptr + seq * stride_tb + j * stride_tn).to(tl.int64)
        k = tl.load(k_base + block * stride_kb)
        scores = _dot(q, k, UPCAST) * scale_log2
        key_pos = j * BLOCK_SIZE + s
        key_ok = (key_pos >= first) & (key_pos < seq_len)
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # Slots outside the window may hold stale or uninitialised values (NaN * 0 is NaN).
        v = tl.load(v_base + block * stride_vb, mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    # A zero-length sequence has no keys: write zeros rather than 0/0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(g < GROUP)[:, None],
    )


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_kh, stride_kb, stride_ks,
    stride_vh, stride_vb, stride_vs,
    stride_tn,
    stride_ot, stride_oh,
    num_tokens, start, scale_log2, window,
    GROUP: tl.constexpr, TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # One program per (tile of TILE new tokens, query head).
    tile = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    i = tile * TILE + tl.arange(0, TILE)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    row_ok = i < num_tokens
    q = tl.load(
        q_ptr + i[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    q_pos = start + i
    # Causal: the tile's last real token bounds the keys it reads, and with a window its first
    # token's window starts them.
    end = start + tl.minimum((tile + 1) * TILE, num_tokens)
    first = tl.where(window > 0, tl.maximum(start + tile * TILE + 1 - window, 0), 0)
    # Row i sees the keys (q_lo, q_pos]; without a window q_lo = -1 is below key 0.
    q_lo = tl.where(window > 0, q_pos - window, -1)
    k_base = k_ptr + kv_head * stride_kh + d[:, None] + s[None, :] * stride_ks  # [D, BS]
    v_base = v_ptr + kv_head * stride_vh + s[:, None] * stride_vs + d[None, :]  # [BS, D]
    m_i = tl.full([TILE], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE], tl.float32)
    acc = tl.zeros([TILE, HEAD_DIM], tl.float32)
    for j in range(first // BLOCK_SIZE, tl.cdiv(end, BLOCK_SIZE)):
        block = tl.load(table_ptr + j * stride_tn).to(tl.int64)
        k = tl.load(k_base + block * stride_kb)
        scores = _dot(q, k, UPCAST) * scale_log2
        key_pos = j * BLOCK_SIZE + s
        visible = (
            (key_pos[None, :] <= q_pos[:, None])
            & (key_pos[None, :] > q_lo[:, None])
            & (key_pos < end)[None, :]
        )
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # With a window, a later row may see no key of the tile's first blocks (and padding
        # rows none at all): shift by 0 there, not by -inf, or exp2(-inf - -inf) is NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # Slots outside the tile's keys may hold stale or uninitialised values (NaN * 0 is NaN).
        key_ok = (key_pos >= first) & (key_pos < end)
        v = tl.load(v_base + block * stride_vb, mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only in padding rows
    tl.store(
        out_ptr + i[:, None].to(tl.int64) * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def _upcast(q: torch.Tensor) -> bool:
    # Kernels see CPU tensors only under the interpreter (see _dot).
    return q.dtype == torch.bfloat16 and q.device.type == "cpu"


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Validate what both kernels share; return the GQA group size."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_kv_heads, num_blocks, block_size, head_dim],"
            f" got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    n_kv, _, block_size, head_dim = k_cache.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size}")
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [*, num_heads, {head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % n_kv != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {n_kv}")
    # The kernels index every other dimension by stride; head_dim must be dense so one
    # head's row is a single vector load.
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(
            f"q, k_cache and v_cache must be on one device, got {q.device}, {k_cache.device}, "
            f"{v_cache.device}"
        )
    return q.shape[1] // n_kv


def _check_index(
    name: str, t: torch.Tensor, device: torch.device, dtypes: tuple[torch.dtype, ...]
) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {dtypes}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def triton_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    key_bias: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``q [B, Hq, D]`` over ``seq_lens[b]`` cached tokens,
    or over the last ``window`` of them, ``[seq_lens[b] - window, seq_lens[b])``.

    ``block_tables [B, max_blocks]`` int64; entries past a sequence's last block, and those
    wholly before its window, are never read, so they may hold anything. ``seq_lens [B]``
    int32/int64, each in ``[1, max_blocks * block_size]`` (not checked: that would sync with
    the device). ``key_bias`` is accepted only for signature compatibility with
    :func:`~hotpool.kernels.paged_attention.paged_decode` and is ignored: the kernel masks
    keys by ``seq_lens`` and ``window`` itself.
    """
    del key_bias
    check_window(window)
    group = _check_cache(q, k_cache, v_cache)
    b = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [{b}, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens must be [{b}], got {tuple(seq_lens.shape)}")
    _check_index("block_tables", block_tables, q.device, (torch.int64,))
    _check_index("seq_lens", seq_lens, q.device, (torch.int32, torch.int64))
    n_kv, _, block_size, head_dim = k_cache.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if b == 0:
        return out
    _decode_kernel[(b, n_kv)](
        q, k_cache, v_cache, block_tables, seq_lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1), seq_lens.stride(0),
        out.stride(0), out.stride(1),
        block_tables.shape[1], head_dim**-0.5 * _LOG2E, window or 0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, UPCAST=_upcast(q),
    )  # fmt: skip
    return out


def triton_paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    window: int | None = None,
) -> torch.Tensor:
    """New tokens ``[start, start + T)`` of one sequence, ``q [T, Hq, D]``, attending causally
    to its cached prefix and to themselves (already written to the cache); with a
    ``window``, token ``i`` attends only keys ``(start + i - window, start + i]``.

    ``block_table [n]`` int64 must cover the ``start + T`` tokens; with a window, entries
    wholly before token 0's window are never read.
    """
    check_window(window)
    group = _check_cache(q, k_cache, v_cache)
    t, n_heads, _ = q.shape
    _, _, block_size, head_dim = k_cache.shape
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    if block_table.dim() != 1:
        raise ValueError(f"block_table must be 1-D [n], got {tuple(block_table.shape)}")
    _check_index("block_table", block_table, q.device, (torch.int64,))
    needed = math.ceil((start + t) / block_size)
    if block_table.shape[0] < needed:
        raise ValueError(
            f"block_table has {block_table.shape[0]} blocks, {start} + {t} tokens need {needed}"
        )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0:
        return out
    _prefill_kernel[(triton.cdiv(t, PREFILL_TILE), n_heads)](
        q, k_cache, v_cache, block_table, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        t, start, head_dim**-0.5 * _LOG2E, window or 0,
        GROUP=group, TILE=PREFILL_TILE, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        UPCAST=_upcast(q),
    )  # fmt: skip
    return out
