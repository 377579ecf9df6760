"""Fused sampling in Triton: a few passes over each row, no sorted copy, no probability tensor.

``triton_sample`` applies the filters in the order of ``hotpool.kernels.sampling`` (whose
module docstring is the specification; penalties are applied to the logits before it):

1. **Logprob** of the sampled token from the logits it is given (``log_softmax`` before
   temperature).
2. **Greedy** when ``temperature < 1e-5`` or ``top_k == 1``: the argmax, lowest index on ties.
3. Weights ``w = exp((x - max) / T)`` (the largest weighs 1). **min_p** keeps ``w >= min_p``.
4. **top_k** keeps tokens whose logit is at least the k-th largest (``0`` or ``>= V``: off).
   Tokens tied with the k-th largest all stay, so a row with ties may keep more than k.
5. **top_p** over the survivors of 3-4: a token stays when the survivors strictly heavier
   than it weigh less than ``top_p`` of the survivors' total (the crossing token stays).
6. **Draw** in two steps, exact in distribution (up to float32 sums and uniforms): a lane
   of the tile (the columns ``l, l + BLOCK, l + 2 * BLOCK, ...``) with probability its
   kept weight over the row's, by one uniform against the running sum over lanes; then a
   column of that lane with probability its weight over the lane's, by a second uniform,
   reading only that lane's ~V/BLOCK logits. The two uniforms are one Philox call at
   ``(seed, offset)``, so the draw is reproducible wherever the row sits in the batch; the
   lanes depend on the tile width, so another width (the CPU's or another GPU launch) may
   draw another token from the same seed. Greedy tokens and logprobs never depend on it.

Each filter keeps an upper set of logits, so the kept set is ``{x >= threshold}``. The
thresholds of top_k and top_p are found by bisection over logit values (FlashInfer's pivot
search): each pass counts (top_k) or weighs (top_p) the tokens above a pivot and snaps the
bracket to the nearest logits actually present, so the search ends on an exact logit. The
search starts from a lower bound found in registers: the lanes' maxima are real logits of
distinct tokens, so the k-th largest of them is at most the k-th largest logit, and tokens
below a lane maximum at which the lane maxima alone weigh top_p are all cut. The bisection
halves an interval of float32 bit patterns, hence at most ~33 passes per filter; rows with
few distinct logits in the bracket finish in a handful.

The passes of the search read the row's candidates, not the row
(``hotpool.kernels.sampling_candidates``): from the first pass alone each row gets a cut
below which nothing can be kept (the bounds above, and for top_p also ``(1 - top_p) / V`` of
the mass, for min_p ``m + T log(min_p)``), and one more pass copies the logits at or above
it into a few slots per lane of scratch memory. Typical rows keep tens to thousands of
candidates out of 128K, which the search then reads from cache. A row without a cut (top_k
over more tokens than there are lanes) or with a lane holding more candidates than its slots
(flat top_p rows) gets a higher cut from passes that try several at once
(``sampling_candidates.narrow``) and is gathered again; one whose kept tokens alone overflow
is searched over the whole row. Either way the result is the same.

Passes over each row: greedy and temperature-only rows read it once, plus the chosen lane;
top_k and top_p rows twice (the first pass and the gathering), plus the chosen lane, and a
row gathered again two to five more; min_p alone once, plus a lane per draw (rejection: see
the draw); rows searched over the whole row once per bisection step on top
(``benchmarks/sampler_traffic.py`` counts them). Every pass keeps running values per lane of
the tile and reduces across the tile once, after the pass.
Rows holding a NaN or +inf, or no finite logit, get token ``-1`` and logprob NaN (the
wrapper does not look, which would wait for the device; ``sample`` raises on -1).

The grammar's token bitmask (``HAS_MASK``, step 1b of ``hotpool.kernels.sampling``) is read
with the logits: every load of a tile of the row also loads the tile's words of the row's
mask and reads a disallowed token as -inf, so every pass above sees only allowed tokens.
The candidates are gathered from masked tiles and read without it; without a mask the
kernel is compiled without those loads.

A program handles ``ROWS`` rows as one ``[ROWS, BLOCK]`` tile, every per-row decision a mask.
On a GPU that is one row per program, ``GPU_BLOCK`` wide, with the next tile's loads issued
before the current one is worked on (``PREFETCH``); in the CPU interpreter
(``TRITON_INTERPRET=1``), which runs programs one after another in Python but each tile op
in numpy, hundreds of rows share a program and a launch of 20,000 rows takes seconds
instead of minutes. Measured on an H200 (``benchmarks/gpu_kernels.py``, docs/gpu_kernels.md)
before the candidates: at B=256, V=128256 fp32, a greedy batch takes 56 us (60% of the copy
bandwidth), a temperature-only one 67 us (50%), top_p=0.9 1.0 ms (a bisection pass over
every row per step); the candidates are not measured on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hotpool.kernels.sampling_candidates import gather, kept_mass, lane_weights, narrow, view
from hotpool.kernels.sampling_pivot_search import (
    any_row,
    load_tile,
    survives,
    threshold,
    tile_bound,
)

# As in hotpool.kernels.sampling: below this the row is greedy.
_GREEDY_BELOW = 1e-5
_MIN_BLOCK = 16  # narrower tiles would only be slower
# The tile width and warps of one program. The interpreter's tile ops run in numpy, where
# width is cheap. On a GPU (one row per program) these were chosen on an H200 by
# ``benchmarks/gpu_kernels.py --sweep``: wide enough that each program keeps enough loads in
# flight to stream its row near the copy bandwidth, few enough lanes per thread that the
# per-lane running values stay in registers (64 per thread at 2048 x 16 warps, none
# spilled; 8192 spills).
_CPU_BLOCK = 1024
_CPU_PREFETCH = False  # numpy gains nothing from loading ahead
GPU_BLOCK = 2048
GPU_WARPS = 16
GPU_PREFETCH = True
# A cap on registers per thread (None: ptxas chooses: 111 at 2048 x 16 with the filters, one
# program per SM; 64 without). ``benchmarks/gpu_kernels.py --sweep`` tries 64 and 80.
GPU_MAXNREG: int | None = None
# Elements of one [ROWS, BLOCK] tile in the interpreter, where wide tiles are cheap.
_CPU_TILE = 2**17
# Candidate slots per lane (``sampling_candidates``): a row whose lane holds more logits above
# its cut is searched over the whole row. At 2048 lanes, 16 slots hold the top_k candidates
# of any k up to a few thousand, and top_p ones of all but the flattest rows (measured on
# rows shaped like a language model's: at T=1, top_p=0.9 about one row in six overflows).
# Scratch: SLOTS * BLOCK float32 per row (128 KB; 32 MB at B=256), mostly never touched.
GPU_SLOTS = 16
_CPU_SLOTS = 16
# Logit cuts derived from weights sit this far lower (a factor e^0.7 ~ 2 in weight), so that
# rounding in exp or log never puts a kept token below its row's cut.
_SLACK = tl.constexpr(0.7)
# Rows whose candidates overflow try this many higher cuts per pass over the row, for at
# most this many passes, before they are searched over the whole row.
_PIVOTS = tl.constexpr(4)
_ROUNDS = tl.constexpr(4)
# Draws a min_p row may reject before it weighs its kept tokens over the whole row (at
# min_p=0.05 the first draw is kept with the kept tokens' share of the mass, mostly > 0.8).
_TRIES = tl.constexpr(4)
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _lane_draw(
    base, row_ok, V, w_l, u_lane, u_in, ref, inv_t, thr, min_p,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, mbase, MASKED: tl.constexpr,
):  # fmt: skip
    """One token per row with probability ``w_i / sum(w)``, in two exact steps: a lane ``l``
    of the tile (columns ``l, l + BLOCK, ...``) with probability ``w_l / sum(w_l)`` from the
    lanes' totals ``w_l`` ``[ROWS, BLOCK]``, by the uniform ``u_lane``; then a column of that
    lane with probability ``w_i / w_l``, by ``u_in``, reading only the lane's own ~V/BLOCK
    logits. ``w_i = exp((x_i - ref) / T)`` for the tokens that survive ``thr`` and ``min_p``
    (the scale of ``w_l``), 0 for the others and for the tokens the bitmask at ``mbase``
    disallows (``MASKED``)."""
    cols = tl.arange(0, BLOCK)[None, :]
    total = tl.sum(w_l, axis=1)
    below = tl.cumsum(w_l, axis=1) <= (u_lane * total)[:, None]
    # The first lane whose running total passes the target; rounding can only overshoot to
    # past the last lane that weighs anything, which then takes it. A row that draws nothing
    # (all weights 0, its token discarded) reads lane 0, never before its first column.
    last = tl.max(tl.where(w_l > 0.0, cols, -1), axis=1)
    lane = tl.maximum(tl.minimum(tl.sum(below.to(tl.int32), axis=1), last), 0)
    js = tl.arange(0, CHUNK)[None, :]
    ref2, inv_t2, thr2, min_p2 = ref[:, None], inv_t[:, None], thr[:, None], min_p[:, None]
    in_lane = tl.zeros([ROWS], tl.float32)
    for j0 in range(0, tl.cdiv(V, BLOCK), CHUNK):
        idx = lane[:, None] + (j0 + js) * BLOCK
        x = load_tile(base, idx, row_ok, V, mbase, MASKED)
        keep, w = survives(x, ref2, inv_t2, thr2, min_p2)
        in_lane += tl.sum(tl.where(keep, w, 0.0), axis=1)
    target = (u_in * in_lane)[:, None]
    seen = tl.zeros([ROWS], tl.float32)
    count = tl.zeros([ROWS], tl.int32)
    last_j = tl.full([ROWS], -1, tl.int32)
    for j0 in range(0, tl.cdiv(V, BLOCK), CHUNK):
        j = j0 + js
        x = load_tile(base, lane[:, None] + j * BLOCK, row_ok, V, mbase, MASKED)
        keep, w = survives(x, ref2, inv_t2, thr2, min_p2)
        w = tl.where(keep, w, 0.0)
        count += tl.sum((seen[:, None] + tl.cumsum(w, axis=1) <= target).to(tl.int32), axis=1)
        last_j = tl.maximum(last_j, tl.max(tl.where(w > 0.0, j, -1), axis=1))
        seen += tl.sum(w, axis=1)
    return lane + tl.minimum(count, last_j) * BLOCK


@triton.jit
def _uniforms(seed, offset, r):
    """Two more uniforms at ``(seed, offset)``, for retry ``r`` (Philox's third counter)."""
    lo = offset.to(tl.uint32)
    n = tl.full(lo.shape, r, tl.uint32)
    a, b, _, _ = tl.philox(seed, lo, (offset >> 32).to(tl.uint32), n, lo * 0)
    return tl.uint_to_uniform_float(a), tl.uint_to_uniform_float(b)


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    offset_ptr,
    token_ptr,
    logprob_ptr,
    cand_ptr,
    mask_ptr,
    stride_mask,
    B,
    V,
    GREEDY_BELOW: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    SLOTS: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    CHUNK: tl.constexpr = 32,
    FILTERS: tl.constexpr = True,
    HAS_MASK: tl.constexpr = False,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    row_base = logits_ptr + rows.to(tl.int64) * stride_row
    base = row_base[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    t = tl.load(temperature_ptr + rows, mask=row_ok, other=1.0)
    k = tl.load(top_k_ptr + rows, mask=row_ok, other=0)
    top_p = tl.load(top_p_ptr + rows, mask=row_ok, other=1.0)
    min_p = tl.load(min_p_ptr + rows, mask=row_ok, other=0.0)
    greedy = (t < GREEDY_BELOW) | (k == 1)
    # FILTERS False: the caller promises no row has top_k, top_p or min_p, and the filters'
    # code is compiled out (fewer registers: two programs per SM where one fits otherwise).
    k_on = (k > 0) & (k < V) & ~greedy & FILTERS
    p_on = (top_p < 1.0) & ~greedy & FILTERS
    filtered = k_on | p_on | ((min_p > 0.0) & ~greedy & FILTERS)
    thin = filtered & ~k_on & ~p_on  # min_p alone: drawn at T with rejection (see the draw)
    plain = ~greedy & ~filtered
    inv_t = 1.0 / tl.maximum(t, GREEDY_BELOW)
    inv_t2 = inv_t[:, None]
    any_filtered = any_row(filtered)
    any_mass = any_row(plain | p_on | thin)  # rows that need the mass at T from pass 1
    cbase = (cand_ptr + rows.to(tl.int64) * (SLOTS * BLOCK))[:, None]  # the candidate slots
    # The grammar's bitmask (HAS_MASK): every read of the row sees its disallowed tokens as
    # -inf, so everything below (max, argmax, weights, cuts, draws) is over allowed ones.
    mbase = (mask_ptr + rows.to(tl.int64) * stride_mask)[:, None]

    # Pass 1: raw max and normaliser (online), argmax, smallest finite logit (filtered rows),
    # and for temperature-only and top_p rows each lane's weight at T. Every lane of the tile
    # keeps its own running values and the row is reduced once after the loop: a reduction
    # across the tile in every step would cost more than the step's loads. A NaN makes the
    # normaliser NaN and +inf the max +inf, which is how such rows are found.
    m_l = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)  # each lane's max
    s_l = tl.zeros([ROWS, BLOCK], tl.float32)  # sum of exp(x - m_l)
    st_l = tl.zeros([ROWS, BLOCK], tl.float32)  # sum of exp((x - m_l) / T)
    best_l = tl.zeros([ROWS, BLOCK], tl.int32)  # where m_l is, first occurrence
    xmin_l = tl.full([ROWS, BLOCK], float("inf"), tl.float32)
    x = load_tile(base, cols, row_ok, V, mbase, HAS_MASK)
    for start in range(0, V, BLOCK):
        idx = start + cols
        if PREFETCH:  # the next tile's loads in flight while this one is worked on
            x_next = load_tile(base, idx + BLOCK, row_ok, V, mbase, HAS_MASK)
        else:
            x = load_tile(base, idx, row_ok, V, mbase, HAS_MASK)
        up = x > m_l
        d = -tl.abs(x - tl.where(m_l > float("-inf"), m_l, 0.0))  # no -inf - -inf
        # One exp per token: exp(-|x - m_l|) rescales the sum when the max moves, else adds.
        some = x != float("-inf")  # NaN included: exp(NaN) poisons the sum
        e = tl.where(some, tl.exp(d), 0.0)
        s_l = tl.where(up, s_l * e + 1.0, s_l + e)
        if any_mass:
            e = tl.where(some, tl.exp(d * inv_t2), 0.0)
            st_l = tl.where(up, st_l * e + 1.0, st_l + e)
        best_l = tl.where(up, idx, best_l)
        if any_filtered:
            xmin_l = tl.minimum(xmin_l, tl.where(some & (x < float("inf")), x, float("inf")))
        m_l = tl.where(up, x, m_l)
        if PREFETCH:
            x = x_next
    m = tl.max(m_l, axis=1)
    finite_m = (m > float("-inf")) & (m < float("inf"))
    m_safe = tl.where(finite_m, m, 0.0)
    # Lanes that saw no finite logit add 0, or NaN if they saw one.
    s = tl.sum(s_l * tl.exp(m_l - m_safe[:, None]), axis=1)
    best = tl.min(tl.where(m_l == m[:, None], best_l, 2147483647), axis=1)
    xmin = tl.min(xmin_l, axis=1)
    # NaN or +inf anywhere, or no finite logit: no distribution to sample (token -1).
    valid = finite_m & (s == s)
    token = best
    # Each lane's weight at T on the row's scale, for the draw.
    w_l = tl.where((plain | thin)[:, None], st_l * tl.exp((m_l - m_safe[:, None]) * inv_t2), 0.0)
    thr = tl.full([ROWS], float("-inf"), tl.float32)
    keep_p = tl.zeros([ROWS], tl.float32)
    todo = filtered & valid
    if FILTERS and any_row(todo):
        mt = m_safe
        mt2, xmin2, min_p2 = mt[:, None], xmin[:, None], min_p[:, None]
        # The lanes' maxima are real logits, each of another token: they bound both
        # thresholds from below, so the searches start close to them.
        tops = tl.where(valid[:, None], m_l, float("-inf"))
        vk = xmin
        k_todo = k_on & todo
        p_todo = p_on & todo
        kf = k.to(tl.float32)
        # Where each row's kept tokens can start at the lowest, from what is in registers:
        # the rows' candidates are the logits at or above it (``sampling_candidates``).
        cut = tl.full([ROWS], float("-inf"), tl.float32)
        kth = cut
        if any_row(k_todo):
            # k lanes hold a logit >= the k-th largest lane maximum, so the k-th largest
            # logit is no smaller (fewer than k finite lanes: no bound).
            kth = tile_bound(tops, (tops > float("-inf")).to(tl.float32), kf)
            cut = tl.where(k_todo, kth, cut)
        p_only = p_todo & ~k_on
        if any_row(p_only):
            # top_p cuts a token when the tokens heavier than it weigh top_p of the
            # survivors' mass M. The whole row's mass at T, ``st``, is at least M: tokens
            # below a lane maximum at which the lane maxima weigh top_p * st are cut. So is a
            # token weighing under (1 - top_p) * M / V: the tokens at or below it cannot
            # weigh 1 - top_p of M. M is ``st`` without min_p and at least 1 (the top token)
            # with it. Logit cuts from weights keep a margin of 2x for rounding (``_SLACK``).
            st = tl.sum(st_l * tl.exp((m_l - mt2) * inv_t2), axis=1)
            keep, w = survives(tops, mt2, inv_t2, xmin2, min_p2)
            by_tops = tile_bound(tops, tl.where(keep, w, 0.0), top_p * st * 1.001)
            # 1.2e-38: the least normal float32 and a bit; Triton types a smaller literal
            # float64, and Triton 3.6 then promotes the cut to float64 (seen on an H200).
            least = tl.where(min_p > 0.0, 1.0, st) * (1.0 - top_p) / V
            by_v = mt + (tl.log(tl.maximum(least, 1.2e-38)) - _SLACK) / inv_t
            cut = tl.where(p_only, tl.maximum(by_tops, by_v), cut)
        # min_p keeps weights >= min_p: logits >= m + T * log(min_p).
        by_min_p = mt + (tl.log(tl.maximum(min_p, 1.2e-38)) - _SLACK) / inv_t
        search = k_todo | p_todo
        cut = tl.where(search & (min_p > 0.0), tl.maximum(cut, by_min_p), cut)
        gathered = search & (cut > float("-inf")) & (SLOTS > 0)  # no slots: as before them
        fast = gathered
        count = tl.zeros([ROWS, BLOCK], tl.int32)
        mass_g = tl.zeros([ROWS], tl.float32)
        if any_row(gathered):
            count, mass_g = gather(
                base, cbase, row_ok & gathered, V, cut, mt, inv_t, xmin, min_p,
                any_row(p_only), BLOCK, ROWS, SLOTS, PREFETCH, mbase, HAS_MASK,
            )  # fmt: skip
            fast = gathered & (tl.max(count, axis=1) <= SLOTS)
        over = search & ~fast  # no bound, or a lane overflowed
        if SLOTS > 0 and any_row(over):
            # Raise their cuts by passes that try several at once (top_k rows by counts,
            # top_p rows by the mass from the gathering), then gather those that now fit.
            lo_c, fits = narrow(
                base, row_ok & over, V, tl.where(gathered, cut, xmin), mt, kf, k_on,
                top_p * mass_g * 1.001, mt, inv_t, xmin, min_p,
                BLOCK, ROWS, SLOTS, _PIVOTS, _ROUNDS, mbase, HAS_MASK,
            )  # fmt: skip
            cut = tl.where(over & (p_only | fits), lo_c, cut)
            refit = over & fits
            if any_row(refit):
                again, _ = gather(
                    base, cbase, row_ok & refit, V, cut, mt, inv_t, xmin, min_p,
                    False, BLOCK, ROWS, SLOTS, PREFETCH, mbase, HAS_MASK,
                )  # fmt: skip
                count = tl.where(refit[:, None], again, count)
                fast = fast | (refit & (tl.max(again, axis=1) <= SLOTS))
        n_c, lim_c = view(count, fast, BLOCK, SLOTS)
        slow = search & ~fast  # searched over the whole row
        if any_row(k_todo):
            lo = tl.maximum(xmin, kth)
            zero = tl.zeros([ROWS], tl.float32)
            found = mt
            if any_row(k_todo & fast):
                found = threshold(
                    cbase, row_ok & fast, n_c, lim_c, tl.where(k_todo & fast, lo, float("inf")),
                    mt, kf, mt, inv_t, xmin, zero, False, BLOCK, ROWS, mbase, False,
                )  # fmt: skip
            if any_row(k_todo & slow):
                whole = threshold(
                    base, row_ok & slow, V, V, tl.where(k_todo & slow, lo, float("inf")),
                    mt, kf, mt, inv_t, xmin, zero, False, BLOCK, ROWS, mbase, HAS_MASK,
                )  # fmt: skip
                found = tl.where(slow, whole, found)
            vk = tl.where(k_todo, found, xmin)
        thr = vk
        if any_row(p_todo):
            # The survivors' mass, and where the top_p search starts: their smallest logit,
            # or the row's cut. A gathered row without top_k has its mass (over the whole
            # row: not all its survivors are candidates) from the gathering; with top_k, a
            # gathered row's survivors are all candidates.
            mass = mass_g
            lowest = cut
            if any_row(p_todo & fast):
                mass_c, lowest_c = kept_mass(
                    cbase, row_ok & fast, n_c, lim_c, mt, inv_t, vk, min_p, BLOCK, ROWS,
                    mbase, False,
                )  # fmt: skip
                mass = tl.where(k_on, mass_c, mass_g)
                lowest = tl.where(fast, lowest_c, lowest)
            weigh = p_todo & slow & (k_on | ~gathered)
            if any_row(weigh):
                mass_s, lowest_s = kept_mass(
                    base, row_ok & weigh, V, V, mt, inv_t, vk, min_p, BLOCK, ROWS,
                    mbase, HAS_MASK,
                )  # fmt: skip
                mass = tl.where(weigh, mass_s, mass)
                lowest = tl.where(weigh, lowest_s, lowest)
            # Tokens below a surviving lane maximum at which the lane maxima alone already
            # weigh top_p of the mass (with a margin for rounding) all fall outside.
            keep, w = survives(tops, mt2, inv_t2, vk[:, None], min_p2)
            bound = tile_bound(tops, tl.where(keep, w, 0.0), top_p * mass * 1.001)
            lo = tl.maximum(tl.maximum(lowest, bound), cut)
            lo = tl.where(p_todo, lo, float("inf"))
            found = vk
            if any_row(p_todo & fast):
                found = threshold(
                    cbase, row_ok & fast, n_c, lim_c, tl.where(fast, lo, float("inf")),
                    mt, top_p * mass, mt, inv_t, vk, min_p, True, BLOCK, ROWS, mbase, False,
                )  # fmt: skip
            if any_row(p_todo & slow):
                whole = threshold(
                    base, row_ok & slow, V, V, tl.where(slow, lo, float("inf")),
                    mt, top_p * mass, mt, inv_t, vk, min_p, True, BLOCK, ROWS, mbase, HAS_MASK,
                )  # fmt: skip
                found = tl.where(slow, whole, found)
            thr = tl.where(p_todo, found, vk)
        thr = tl.where(todo, thr, float("-inf"))
        keep_p = tl.where(todo & ~thin, min_p, 0.0)
        # Each lane's weight of the kept tokens, for the draw: every kept token of a
        # gathered row is one of its candidates, in the same lane.
        kw_l = tl.zeros([ROWS, BLOCK], tl.float32)
        if any_row(fast):
            kw_l = lane_weights(
                cbase, row_ok & fast, n_c, lim_c, mt, inv_t, thr, keep_p, BLOCK, ROWS,
                mbase, False,
            )  # fmt: skip
        if any_row(slow):
            kw_w = lane_weights(
                base, row_ok & slow, V, V, mt, inv_t, thr, keep_p, BLOCK, ROWS, mbase, HAS_MASK
            )
            kw_l = tl.where(slow[:, None], kw_w, kw_l)
        w_l = tl.where(search[:, None], kw_l, w_l)
    draw = (plain & valid) | todo
    if any_row(draw):
        # Two uniforms per row, from one Philox call at (seed, offset).
        seed = tl.load(seed_ptr + rows, mask=row_ok, other=0)
        offset = tl.load(offset_ptr + rows, mask=row_ok, other=0)
        u_lane, u_in, u_lane2, u_in2 = tl.rand4x(seed, offset)
        picked = _lane_draw(
            base, row_ok, V, w_l, u_lane, u_in, m_safe, inv_t, thr, keep_p, BLOCK, ROWS, CHUNK,
            mbase, HAS_MASK,
        )  # fmt: skip
        token = tl.where(draw, picked, token)
        if FILTERS:
            # min_p alone: a token drawn at T is kept if it survives min_p, else drawn again
            # (rejection: exactly the kept tokens' distribution, each draw reading one lane
            # where weighing the kept tokens per lane reads the whole row); rows still
            # drawing after _TRIES draws weigh them and draw once more, from uniforms of
            # their own (exact too: every way out draws from the same distribution).
            drawing = thin & valid
            for r in tl.static_range(_TRIES):
                x_tok = tl.load(row_base + token, mask=row_ok & drawing, other=0.0)
                kept = tl.exp((x_tok.to(tl.float32) - m_safe) * inv_t) >= min_p
                drawing = drawing & ~kept
                if any_row(drawing):
                    if r == 0:
                        ul, ui = u_lane2, u_in2
                    else:  # the retry's number in Philox's third counter word
                        ul, ui = _uniforms(seed, offset, r)
                    if r == _TRIES - 1:  # the last way out: the kept tokens' weights
                        w_l = tl.where(
                            drawing[:, None],
                            lane_weights(
                                base, row_ok & drawing, V, V, m_safe, inv_t, thr, min_p,
                                BLOCK, ROWS, mbase, HAS_MASK,
                            ),
                            w_l,
                        )  # fmt: skip
                        keep_p = tl.where(drawing, min_p, keep_p)
                    again = _lane_draw(
                        base, row_ok & drawing, V, w_l, ul, ui, m_safe, inv_t, thr, keep_p,
                        BLOCK, ROWS, CHUNK, mbase, HAS_MASK,
                    )  # fmt: skip
                    token = tl.where(drawing, again, token)

    token = tl.where(valid, token, -1)
    tl.store(token_ptr + rows, token.to(tl.int64), mask=row_ok)
    chosen = tl.load(row_base + token, mask=row_ok & valid, other=0.0).to(tl.float32)
    logprob = tl.where(valid, chosen - (m + tl.log(tl.where(valid, s, 1.0))), float("nan"))
    tl.store(logprob_ptr + rows, logprob, mask=row_ok)


def _check_param(name: str, t: torch.Tensor, dtype: torch.dtype, b: int, dev: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != (b,):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a [{b}] tensor, got {shape}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != dev:
        raise ValueError(f"{name} is on {t.device}, logits on {dev}")
    if b > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def interpreted() -> bool:
    """Whether the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1`` was set
    when this module was imported): then it takes CPU tensors, and only those."""
    return not isinstance(_sample_kernel, triton.runtime.JITFunction)


def kernel_device() -> torch.device:
    """Where the kernel's tensors must live: the CPU under the interpreter, else CUDA."""
    return torch.device("cpu" if interpreted() else "cuda")


def _rows_per_program(b: int, block: int, on_gpu: bool) -> int:
    """One row per program on a GPU: wider tiles cost registers (sm_90: 40 per thread for one
    row, 110 for four rows of 64, spilling at sixteen), and a row's token then never depends
    on the batch. The interpreter takes as many rows as fit a tile, no more than the batch."""
    if on_gpu:
        return 1
    return max(1, min(triton.next_power_of_2(b), _CPU_TILE // block))


def triton_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    rows_per_program: int | None = None,
    block: int | None = None,
    slots: int | None = None,
    filters: bool = True,
    token_bitmask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``[B, V]`` and its logprob: ``([B] int64,
    [B] float32)``, on the logits' device, without waiting for it. A row holding NaN or
    +inf, or no finite logit, gets token -1 and logprob NaN.

    Per row: ``temperature`` float32 (< 1e-5: greedy), ``top_k`` int32 (0: off), ``top_p``
    and ``min_p`` float32, ``seeds`` and ``offsets`` int64 (the draw is a function of
    ``(seed, offset)`` and the row alone). Columns must be contiguous; rows may be strided.
    Parameter ranges are the caller's to check (``SamplingRow`` does).
    ``rows_per_program`` and ``block``, the tile width (powers of two, block >= 16; None:
    chosen by device), change the speed only: no token depends on them. Nor does ``slots``,
    the candidates a lane may hold (``sampling_candidates``; 0: every top_k and top_p row
    is searched over the whole row; None: chosen by device). ``filters=False`` promises that
    no row has top_k, top_p or min_p (checked by the caller on the host, where the rows are:
    here it would wait for the device): the kernel is then compiled without their code, with
    fewer registers; a row that has them anyway is sampled at its temperature alone.
    ``token_bitmask``: the grammar's int32 ``[B, (V + 31) // 32]`` on the logits' device
    (``hotpool.kernels.sampling_bitmask``; words contiguous), or None: every read of a row
    sees the tokens it disallows as -inf (the logprob, too, is then over the allowed tokens;
    ``sample`` reports the raw one), and a row with nothing allowed finite gets token -1.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] == 0:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)
        raise ValueError(f"logits must be [B, V > 0], got {shape}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    b, v = logits.shape
    if v > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits columns must be contiguous (stride 1), got {logits.stride()}")
    dev = logits.device
    if (dev.type == "cpu") != interpreted():
        raise ValueError(
            f"logits are on {dev}: the Triton sampler runs on CUDA, or on the CPU when "
            "TRITON_INTERPRET=1 is set before triton is imported"
        )
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int32),
        ("top_p", top_p, torch.float32),
        ("min_p", min_p, torch.float32),
        ("seeds", seeds, torch.int64),
        ("offsets", offsets, torch.int64),
    ):
        _check_param(name, t, dtype, b, dev)
    words = triton.cdiv(v, 32)
    if token_bitmask is not None:
        m = token_bitmask
        if m.dtype != torch.int32 or m.shape != (b, words) or m.device != dev:
            raise ValueError(
                f"token_bitmask must be [{b}, {words}] int32 on {dev}, "
                f"got {tuple(m.shape)} {m.dtype} on {m.device}"
            )
        if words > 1 and m.stride(1) != 1:
            raise ValueError(f"token_bitmask words must be contiguous, got {m.stride()}")
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logprobs = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return tokens, logprobs
    on_gpu = dev.type != "cpu"
    if block is None:
        widest = GPU_BLOCK if on_gpu else _CPU_BLOCK
        block = max(_MIN_BLOCK, min(widest, triton.next_power_of_2(v)))
    elif block < _MIN_BLOCK or block & (block - 1):
        raise ValueError(f"block must be a power of two >= {_MIN_BLOCK}, got {block}")
    rows = rows_per_program or _rows_per_program(b, block, on_gpu)
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows}")
    if slots is None:
        slots = GPU_SLOTS if on_gpu else _CPU_SLOTS
    elif slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")
    # A lane of a row holds at most cdiv(V, block) logits: so many slots never overflow.
    # Without filters nothing is gathered: no scratch.
    slots = min(slots, triton.cdiv(v, block)) if filters else 0
    # Written only where a row has candidates, read only where written: never cleared.
    candidates = torch.empty(b, slots * block, dtype=torch.float32, device=dev)
    _sample_kernel[(triton.cdiv(b, rows),)](
        logits,
        logits.stride(0),
        temperature,
        top_k,
        top_p,
        min_p,
        seeds,
        offsets,
        tokens,
        logprobs,
        candidates,
        top_k if token_bitmask is None else token_bitmask,  # int32 either way, unread if none
        0 if token_bitmask is None else token_bitmask.stride(0),
        b,
        v,
        GREEDY_BELOW=_GREEDY_BELOW,
        BLOCK=block,
        ROWS=rows,
        SLOTS=slots,
        FILTERS=filters,
        HAS_MASK=token_bitmask is not None,
        PREFETCH=GPU_PREFETCH if on_gpu else _CPU_PREFETCH,
        num_warps=max(1, min(GPU_WARPS, block // 256)) if rows == 1 else 4,
        **({"maxnreg": GPU_MAXNREG} if on_gpu and GPU_MAXNREG else {}),
    )
    return tokens, logprobs
