"""The Triton pieces of the sampling kernel's filters: tile loads, the mask of tokens that
survive min_p and a threshold, and the pivot search that finds the top_k and top_p
thresholds as exact logits (see ``hotpool.kernels.triton_sampling``).

Every function works on a ``[ROWS, BLOCK]`` tile with per-row ``[ROWS]`` state, each row's
decisions its own masks, so one program may carry many rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def float_key(f):
    """An int64 whose order is the order of the float32 ``f`` (for bisection over bits)."""
    b = f.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def float_unkey(k):
    k32 = k.to(tl.int32)
    return tl.where(k32 >= 0, k32, k32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def any_row(mask):
    return tl.max(mask.to(tl.int32), axis=0) > 0


@triton.jit
def load_tile(base, idx, row_ok, limit, mbase, MASKED: tl.constexpr):
    """The tile ``[ROWS, BLOCK]`` at columns ``idx`` ``[1, BLOCK]``, -inf at or past
    ``limit`` (the row length, or a limit per lane: see ``sampling_candidates.view``) and in
    rows not in ``row_ok``, float32. ``MASKED``: the tile is of the row itself and ``mbase``
    ``[ROWS, 1]`` points at each row's token bitmask (int32 words, bit ``j`` of word ``w``
    allowing token ``32 * w + j``): a token it disallows reads -inf too. Candidates were
    gathered from masked tiles and are read without it."""
    mask = row_ok[:, None] & (idx < limit)
    x = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
    if MASKED:
        words = tl.load(mbase + (idx >> 5), mask=mask, other=0)
        x = tl.where(((words >> (idx & 31)) & 1) != 0, x, float("-inf"))
    return x


@triton.jit
def survives(x, m, inv_t, vk, min_p):
    # -inf logits weigh 0 and never survive: min_p > 0 or x >= vk (finite) excludes them.
    w = tl.exp((x - m) * inv_t)
    return (x >= vk) & (w >= min_p) & (x > float("-inf")), w


@triton.jit
def tile_bound(vals, w, c):
    """Per row of the tile ``vals``, the largest value ``L`` in it whose entries ``>= L``
    weigh at least ``c`` (``w`` per entry, >= 0); -inf where even all of them weigh less.
    ``L`` is found by bisection over float32 bit patterns, in registers (32 steps)."""
    ok = tl.sum(w, axis=1) >= c
    finite = tl.where(vals > float("-inf"), vals, float("inf"))
    lo = float_key(tl.min(finite, axis=1))  # where f(v) = weight of entries >= v is >= c
    hi = float_key(tl.max(vals, axis=1))
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        f = tl.sum(tl.where(vals >= float_unkey(mid)[:, None], w, 0.0), axis=1)
        lo = tl.where(f >= c, mid, lo)
        hi = tl.where(f >= c, hi, mid - 1)
    return tl.where(ok & (lo <= hi), float_unkey(lo), float("-inf"))


@triton.jit
def threshold(
    base,
    row_ok,
    N,
    limit,
    lo,
    hi,
    c,
    m,
    inv_t,
    vk,
    min_p,
    BY_MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    mbase,
    MASKED: tl.constexpr,
    VALUE_ROUNDS: tl.constexpr = 24,
):
    """Per row, the smallest logit ``v`` in ``[lo, hi]`` whose surviving tokens above it
    count (``BY_MASS`` False) or weigh less than ``c``; ``v = hi`` must qualify, ``c > 0``.
    Rows with ``lo > hi`` are left out and get ``hi``. Each step reads positions ``[0, N)``
    before ``limit`` (``load_tile``, with ``mbase`` and ``MASKED``): a whole row, or its
    candidates.

    The answer is a logit in ``[lo, hb]`` or ``hi``: a pivot that qualifies moves ``hi`` to
    the smallest logit >= it and ``hb`` to the largest below it, one that fails moves ``lo``
    to the smallest logit above it.
    """
    cols = tl.arange(0, BLOCK)[None, :]
    m2, inv_t2, vk2, min_p2 = m[:, None], inv_t[:, None], vk[:, None], min_p[:, None]
    hb = hi
    active = hb >= lo
    rounds = 0
    while any_row(active):
        a = tl.where(active, lo, 0.0)
        b = tl.where(active, hb, 0.0)
        # Halving the values finds well-spread logits in ~log2(V) passes; halving the bit
        # patterns afterwards bounds the worst case (at most ~33 more passes).
        if rounds < VALUE_ROUNDS:
            p = tl.minimum(tl.maximum(a * 0.5 + b * 0.5, a), b)
        else:
            ka = float_key(a)
            p = float_unkey(ka + (float_key(b) - ka) // 2)
        rounds += 1
        p2 = p[:, None]
        # Per-lane sums and extremes, reduced once after the pass (see the sampling kernel).
        g_l = tl.zeros([ROWS, BLOCK], tl.float32)
        above_l = tl.full([ROWS, BLOCK], float("inf"), tl.float32)  # smallest logit > p
        at_or_above_l = tl.full([ROWS, BLOCK], float("inf"), tl.float32)  # smallest >= p
        below_l = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)  # largest logit < p
        for start in range(0, N, BLOCK):
            x = load_tile(base, start + cols, row_ok, limit, mbase, MASKED)
            keep, w = survives(x, m2, inv_t2, vk2, min_p2)
            gt = keep & (x > p2)
            if BY_MASS:
                g_l += tl.where(gt, w, 0.0)
            else:
                g_l += gt.to(tl.float32)
            above_l = tl.minimum(above_l, tl.where(gt, x, float("inf")))
            at_or_above_l = tl.minimum(at_or_above_l, tl.where(keep & (x >= p2), x, float("inf")))
            below_l = tl.maximum(below_l, tl.where(keep & (x < p2), x, float("-inf")))
        g = tl.sum(g_l, axis=1)
        above = tl.min(above_l, axis=1)
        at_or_above = tl.min(at_or_above_l, axis=1)
        below = tl.max(below_l, axis=1)
        fits = active & (g < c)
        hi = tl.where(fits, at_or_above, hi)
        hb = tl.where(fits, below, hb)
        lo = tl.where(active & ~fits, above, lo)
        active = active & (hb >= lo)
    return hi
