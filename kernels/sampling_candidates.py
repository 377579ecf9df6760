"""The candidates of a filtered row: its logits that may survive top_k and top_p, gathered
in one pass so that the threshold searches read them instead of the whole row.

Each filter keeps an upper set of logits, and bounds on where those sets start come out of
the first pass for free (``hotpool.kernels.triton_sampling``): a row's candidates are its
logits at or above such a bound, ``cut``. One pass over the row copies them into the row's
candidate slots, a ``[SLOTS, BLOCK]`` block of scratch memory in which lane ``l`` of the tile
keeps its ``j``-th candidate at ``j * BLOCK + l``: every lane counts its own candidates in a
register, so the pass needs nothing across the tile, and a lane's candidates stay in the
row's order. A row with a lane holding more than ``SLOTS`` candidates overflows: ``narrow``
raises its cut with passes that try several at once, and it is gathered again; a row whose
surely-kept tokens alone overflow is searched over the whole row instead.

Seen through its slots (``view``), a row's candidates are a shorter row in which each column
is the lane of the same column of the full row: the top_k and top_p searches, the survivors'
mass and each lane's kept weight are the same functions over either, given a loop bound ``N``
and a per-lane ``limit`` of the positions to read. On a GPU the slots of a row are a few
kilobytes, written moments before and read from cache, where each step of the search over the
full row streamed its ~0.5 MB from memory again.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hotpool.kernels.sampling_pivot_search import any_row, load_tile, survives


@triton.jit
def gather(
    base, cbase, row_ok, V, cut, m, inv_t, floor, min_p,
    WANT_MASS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SLOTS: tl.constexpr,
    PREFETCH: tl.constexpr, mbase, MASKED: tl.constexpr,
):  # fmt: skip
    """Copy each row's logits ``>= cut`` into its slots at ``cbase`` ``[ROWS, 1]``; rows
    not in ``row_ok`` copy nothing. Returns each lane's count of candidates ``[ROWS,
    BLOCK]`` (past ``SLOTS``: the row overflowed, and only its first ``SLOTS`` per lane
    were kept) and, with ``WANT_MASS``, each row's mass of the tokens that survive ``floor``
    and ``min_p`` (the whole row's, not only its candidates'). ``mbase``, ``MASKED``: the
    rows' token bitmask (``load_tile``); a disallowed token is never a candidate."""
    cols = tl.arange(0, BLOCK)[None, :]
    cut2, m2, inv_t2 = cut[:, None], m[:, None], inv_t[:, None]
    floor2, min_p2 = floor[:, None], min_p[:, None]
    count = tl.zeros([ROWS, BLOCK], tl.int32)
    mass_l = tl.zeros([ROWS, BLOCK], tl.float32)
    x = load_tile(base, cols, row_ok, V, mbase, MASKED)
    for start in range(0, V, BLOCK):
        if PREFETCH:  # as in the first pass: the next tile's loads in flight meanwhile
            x_next = load_tile(base, start + BLOCK + cols, row_ok, V, mbase, MASKED)
        else:
            x = load_tile(base, start + cols, row_ok, V, mbase, MASKED)
        # Past the row's end x is -inf, below the gathered rows' finite cuts.
        take = (x >= cut2) & row_ok[:, None]
        tl.store(cbase + count * BLOCK + cols, x, mask=take & (count < SLOTS))
        count += take.to(tl.int32)
        if WANT_MASS:
            keep, w = survives(x, m2, inv_t2, floor2, min_p2)
            mass_l += tl.where(keep, w, 0.0)
        if PREFETCH:
            x = x_next
    return count, tl.sum(mass_l, axis=1)


@triton.jit
def view(count, use, BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    """The loop bound (a scalar) and per-lane limit ``[ROWS, BLOCK]`` that read the slots
    of the rows in ``use`` (and nothing of the others) through ``load_tile``: position
    ``j * BLOCK + l`` is read while ``j`` is below lane ``l``'s count."""
    cols = tl.arange(0, BLOCK)[None, :]
    held = tl.where(use[:, None], tl.minimum(count, SLOTS), 0)
    return tl.max(tl.max(held, axis=1), axis=0) * BLOCK, held * BLOCK + cols


@triton.jit
def kept_mass(
    base, row_ok, N, limit, m, inv_t, vk, min_p, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    mbase, MASKED: tl.constexpr,
):  # fmt: skip
    """Per row, the mass of the tokens that survive ``vk`` and ``min_p``, and the smallest
    of their logits (where the top_p search starts), over a row (masked by ``mbase`` where
    ``MASKED``) or its candidates."""
    cols = tl.arange(0, BLOCK)[None, :]
    m2, inv_t2, vk2, min_p2 = m[:, None], inv_t[:, None], vk[:, None], min_p[:, None]
    mass_l = tl.zeros([ROWS, BLOCK], tl.float32)
    lo_l = tl.full([ROWS, BLOCK], float("inf"), tl.float32)
    for start in range(0, N, BLOCK):
        x = load_tile(base, start + cols, row_ok, limit, mbase, MASKED)
        keep, w = survives(x, m2, inv_t2, vk2, min_p2)
        mass_l += tl.where(keep, w, 0.0)
        lo_l = tl.minimum(lo_l, tl.where(keep, x, float("inf")))
    return tl.sum(mass_l, axis=1), tl.min(lo_l, axis=1)


@triton.jit
def lane_weights(
    base, row_ok, N, limit, m, inv_t, thr, min_p, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    mbase, MASKED: tl.constexpr,
):  # fmt: skip
    """Each lane's weight of the kept tokens ``[ROWS, BLOCK]`` (those at or above ``thr``
    that survive ``min_p``), over a row (masked by ``mbase`` where ``MASKED``) or its
    candidates: the same, as every kept token of lane ``l`` is a candidate of lane ``l``."""
    cols = tl.arange(0, BLOCK)[None, :]
    m2, inv_t2, thr2, min_p2 = m[:, None], inv_t[:, None], thr[:, None], min_p[:, None]
    kw_l = tl.zeros([ROWS, BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        x = load_tile(base, start + cols, row_ok, limit, mbase, MASKED)
        keep, w = survives(x, m2, inv_t2, thr2, min_p2)
        kw_l += tl.where(keep, w, 0.0)
    return kw_l


@triton.jit
def narrow(
    base, row_ok, V, lo, hi, k, by_count, need, m, inv_t, floor, min_p,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SLOTS: tl.constexpr,
    PIVOTS: tl.constexpr, ROUNDS: tl.constexpr, mbase, MASKED: tl.constexpr,
):  # fmt: skip
    """Raise the cut ``lo`` of each row in ``row_ok`` (below every token it may keep)
    until its candidates fit the slots. Each pass over the row tries ``PIVOTS`` cuts evenly
    spaced in ``(lo, hi)`` at once and keeps the highest that is still below every kept
    token: one with at least ``k`` logits at or above it (rows ``by_count``: top_k keeps
    at least the k largest), or with the survivors of ``floor`` and ``min_p`` at or above it
    weighing at least ``need`` (top_p: every token below it is cut). A row stops once no lane
    holds more than ``SLOTS`` logits at or above its cut, once a lane holds more than that of
    the tokens it surely keeps (above a pivot that failed), or after ``ROUNDS`` passes.
    Returns the cuts and whether they fit. ``hi`` only places the pivots: a row's highest
    logit, lowered to the first pivot that failed. ``mbase``, ``MASKED``: the rows' token
    bitmask (``load_tile``)."""
    cols = tl.arange(0, BLOCK)[None, :]
    js = tl.arange(0, PIVOTS)[None, :]
    m2, inv_t2, floor2, min_p2 = m[:, None], inv_t[:, None], floor[:, None], min_p[:, None]
    active = row_ok
    fits = row_ok & ~row_ok  # none yet
    for _ in range(ROUNDS):
        if any_row(active):
            q = lo[:, None] + (hi - lo)[:, None] * ((js + 1).to(tl.float32) / (PIVOTS + 1))
            q3 = q[:, :, None]
            count = tl.zeros([ROWS, PIVOTS, BLOCK], tl.int32)
            mass = tl.zeros([ROWS, PIVOTS, BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                x = load_tile(base, start + cols, active, V, mbase, MASKED)
                above = x[:, None, :] >= q3
                count += above.to(tl.int32)
                keep, w = survives(x, m2, inv_t2, floor2, min_p2)
                mass += tl.where(above & keep[:, None, :], w[:, None, :], 0.0)
            total = tl.sum(count, axis=2).to(tl.float32)  # [ROWS, PIVOTS]
            widest = tl.max(count, axis=2)
            weight = tl.sum(mass, axis=2)
            ok = tl.where(by_count[:, None], total >= k[:, None], weight >= need[:, None])
            # The pivots that qualify, counted from the lowest up to the first that does not
            # (whatever rounding does to the sums, the cut only takes a qualifying one).
            n_ok = tl.sum((tl.cumsum(ok.to(tl.int32), axis=1) == js + 1).to(tl.int32), axis=1)
            best = js == (n_ok - 1)[:, None]
            raised = n_ok > 0
            new_lo = tl.where(raised, tl.sum(tl.where(best, q, 0.0), axis=1), lo)
            first_failed = js == n_ok[:, None]
            some_failed = n_ok < PIVOTS
            new_hi = tl.where(some_failed, tl.sum(tl.where(first_failed, q, 0.0), axis=1), hi)
            done = active & raised & (tl.sum(tl.where(best, widest, 0), axis=1) <= SLOTS)
            # The tokens above a pivot that failed are all kept (give or take the margin of
            # ``need``): where a lane holds more of them than its slots, no cut can fit.
            hopeless = some_failed & (tl.sum(tl.where(first_failed, widest, 0), axis=1) > SLOTS)
            lo = tl.where(active, new_lo, lo)
            hi = tl.where(active, new_hi, hi)
            fits = fits | done
            active = active & ~done & ~hopeless
    return lo, fits
