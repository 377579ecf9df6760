"""Fused sampling in Triton: one program per row, a few passes over the row, no sorted copy.

``triton_sample`` applies the filters in the order of ``hotpool.kernels.sampling`` (whose
module docstring is the specification; penalties are applied to the logits before it):

1. **Logprob** of the sampled token from the RAW logits (``log_softmax`` before temperature).
2. **Greedy** when ``temperature < 1e-5`` or ``top_k == 1``: the argmax, lowest index on ties.
3. Weights ``w = exp((x - max) / T)`` (the largest weighs 1). **min_p** keeps ``w >= min_p``.
4. **top_k** keeps tokens whose logit is at least the k-th largest (``0`` or ``>= V``: off).
   Tokens tied with the k-th largest all stay, so a row with ties may keep more than k.
5. **top_p** over the survivors of 3-4: a token stays when the survivors strictly heavier
   than it weigh less than ``top_p`` of the survivors' total (the crossing token stays).
6. **Draw** by the Gumbel-max identity restricted to the kept tokens:
   ``argmax(x / T - log(-log(u_i)))`` with ``u_i = rand(seed, offset * V + i)``, exact in
   distribution (up to float32 uniforms) and reproducible from ``(seed, offset)`` wherever
   the row sits in the batch.

Each filter keeps an upper set of logits, so the kept set is ``{x >= threshold}``. The
thresholds of top_k and top_p are found by bisection over logit values (FlashInfer's pivot
search): each pass counts (top_k) or weighs (top_p) the tokens above a pivot and snaps the
bracket to the nearest logits actually present, so the search ends on an exact logit. The
bisection halves an interval of float32 bit patterns, hence at most ~33 passes per filter;
rows with few distinct logits finish in a handful.

Passes per row: greedy and temperature-only rows read the row once; filtered rows read it
once for the max and normaliser, once per bisection step, once for the top_p mass and once
to draw. Rows holding a NaN or +inf, or no finite logit, get token ``-1`` and logprob NaN
(the wrapper does not look, which would wait for the device; the caller raises on -1).
So far the kernel has run only under the CPU interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# As in hotpool.kernels.sampling: below this the row is greedy.
_GREEDY_BELOW = 1e-5
_MAX_BLOCK = 1024
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _key(f):
    """An int64 whose order is the order of the float32 ``f`` (for bisection over bits)."""
    b = f.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _unkey(k):
    k32 = k.to(tl.int32)
    return tl.where(k32 >= 0, k32, k32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _gumbel_scores(x, idx, seed, counter, inv_t):
    # u = 0 (odds 2**-31) would score -inf; a tiny floor keeps the log finite instead.
    u = tl.maximum(tl.rand(seed, counter + idx), 1e-30)
    return x * inv_t - tl.log(-tl.log(u))  # x / T + Gumbel(0, 1)


@triton.jit
def _survives(x, m, inv_t, vk, min_p):
    # -inf logits weigh 0 and never survive: min_p > 0 or x >= vk (finite) excludes them.
    w = tl.exp((x - m) * inv_t)
    return (x >= vk) & (w >= min_p) & (x > float("-inf")), w


@triton.jit
def _threshold(
    base,
    V,
    lo,
    hi,
    c,
    m,
    inv_t,
    vk,
    min_p,
    BY_MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    VALUE_ROUNDS: tl.constexpr = 24,
):
    """The smallest logit ``v`` in ``[lo, hi]`` whose surviving tokens above it count
    (``BY_MASS`` False) or weigh less than ``c``; ``v = hi`` must qualify, ``c > 0``.

    The answer is a logit in ``[lo, hb]`` or ``hi``: a pivot that qualifies moves ``hi`` to
    the smallest logit >= it and ``hb`` to the largest below it, one that fails moves ``lo``
    to the smallest logit above it.
    """
    hb = hi
    rounds = 0
    while hb >= lo:
        # Halving the values finds well-spread logits in ~log2(V) passes; halving the bit
        # patterns afterwards bounds the worst case (at most ~33 more passes).
        if rounds < VALUE_ROUNDS:
            p = tl.minimum(tl.maximum(lo * 0.5 + hb * 0.5, lo), hb)
        else:
            klo = _key(lo)
            p = _unkey(klo + (_key(hb) - klo) // 2)
        rounds += 1
        g = 0.0
        above = float("inf")  # smallest logit > p
        at_or_above = float("inf")  # smallest logit >= p
        below = float("-inf")  # largest logit < p
        for start in range(0, V, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            keep, w = _survives(x, m, inv_t, vk, min_p)
            gt = keep & (x > p)
            if BY_MASS:
                g += tl.sum(tl.where(gt, w, 0.0))
            else:
                g += tl.sum(gt.to(tl.float32))
            above = tl.minimum(above, tl.min(tl.where(gt, x, float("inf"))))
            ge = keep & (x >= p)
            at_or_above = tl.minimum(at_or_above, tl.min(tl.where(ge, x, float("inf"))))
            below = tl.maximum(below, tl.max(tl.where(keep & (x < p), x, float("-inf"))))
        if g < c:
            hi = at_or_above
            hb = below
        else:
            lo = above
    return hi


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
    V,
    GREEDY_BELOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    t = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    seed = tl.load(seed_ptr + row)
    counter = tl.load(offset_ptr + row) * V
    greedy = (t < GREEDY_BELOW) | (k == 1)
    k_on = (k > 0) & (k < V)
    filtered = (k_on | (top_p < 1.0) | (min_p > 0.0)) & ~greedy
    plain = ~greedy & ~filtered
    inv_t = 1.0 / tl.maximum(t, GREEDY_BELOW)

    # Pass 1: raw max and normaliser (online), argmax, smallest finite logit, NaNs, and for
    # temperature-only rows the Gumbel-max draw itself.
    m = float("-inf")
    s = 0.0
    best = -1
    xmin = float("inf")
    nans = 0
    score = float("-inf")
    token = -1
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < V
        x = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
        finite = x > float("-inf")
        nans += tl.sum((x != x).to(tl.int32))
        bm = tl.max(x)
        if bm > m:  # strict: an earlier block keeps a tie
            best = start + tl.argmax(x, 0)
        m_new = tl.maximum(m, bm)
        if m_new > float("-inf"):
            s = s * tl.exp(m - m_new) + tl.sum(tl.where(finite, tl.exp(x - m_new), 0.0))
        m = m_new
        xmin = tl.minimum(xmin, tl.min(tl.where(finite, x, float("inf"))))
        if plain:
            sc = tl.where(mask, _gumbel_scores(x, idx, seed, counter, inv_t), float("-inf"))
            bs = tl.max(sc)
            if bs > score:
                score = bs
                token = start + tl.argmax(sc, 0)
    if greedy:
        token = best
    # NaN or +inf anywhere, or no finite logit: no distribution to sample (token -1).
    valid = (nans == 0) & (m > float("-inf")) & (m < float("inf"))

    if filtered & valid:
        vk = xmin
        if k_on:
            vk = _threshold(base, V, xmin, m, k.to(tl.float32), m, inv_t, xmin, 0.0, False, BLOCK)
        thr = vk
        if top_p < 1.0:
            # The survivors' mass and smallest logit, where the top_p search starts.
            mass = 0.0
            lo = float("inf")
            for start in range(0, V, BLOCK):
                idx = start + tl.arange(0, BLOCK)
                x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
                keep, w = _survives(x, m, inv_t, vk, min_p)
                mass += tl.sum(tl.where(keep, w, 0.0))
                lo = tl.minimum(lo, tl.min(tl.where(keep, x, float("inf"))))
            thr = _threshold(base, V, lo, m, top_p * mass, m, inv_t, vk, min_p, True, BLOCK)
        for start in range(0, V, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            keep, _ = _survives(x, m, inv_t, thr, min_p)
            sc = _gumbel_scores(x - m, idx, seed, counter, inv_t)
            sc = tl.where(keep, sc, float("-inf"))
            bs = tl.max(sc)
            if bs > score:
                score = bs
                token = start + tl.argmax(sc, 0)

    if ~valid:
        token = -1
    tl.store(token_ptr + row, token.to(tl.int64))
    logprob = float("nan")
    if valid:
        chosen = tl.load(base + token).to(tl.float32)
        logprob = chosen - (m + tl.log(s))
    tl.store(logprob_ptr + row, logprob)


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


def triton_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``[B, V]`` and its raw logprob: ``([B] int64,
    [B] float32)``, on the logits' device, without waiting for it.

    Per row: ``temperature`` float32 (< 1e-5: greedy), ``top_k`` int32 (0: off), ``top_p``
    and ``min_p`` float32, ``seeds`` and ``offsets`` int64 (the draw is a function of
    ``(seed, offset)`` and the row alone). Columns must be contiguous; rows may be strided.
    Parameter ranges are the caller's to check (``SamplingRow`` does).
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
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int32),
        ("top_p", top_p, torch.float32),
        ("min_p", min_p, torch.float32),
        ("seeds", seeds, torch.int64),
        ("offsets", offsets, torch.int64),
    ):
        _check_param(name, t, dtype, b, dev)
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logprobs = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return tokens, logprobs
    block = min(_MAX_BLOCK, triton.next_power_of_2(v))
    _sample_kernel[(b,)](
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
        v,
        GREEDY_BELOW=_GREEDY_BELOW,
        BLOCK=block,
    )
    return tokens, logprobs
