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
6. **Draw** by the Gumbel-max identity restricted to the kept tokens:
   ``argmax((x - max) / T - log(-log(u_i)))`` with ``u_i = rand(seed, offset * V + i)``,
   exact in distribution (up to float32 uniforms) and reproducible from ``(seed, offset)``
   wherever the row sits in the batch.

Each filter keeps an upper set of logits, so the kept set is ``{x >= threshold}``. The
thresholds of top_k and top_p are found by bisection over logit values (FlashInfer's pivot
search): each pass counts (top_k) or weighs (top_p) the tokens above a pivot and snaps the
bracket to the nearest logits actually present, so the search ends on an exact logit. The
bisection halves an interval of float32 bit patterns, hence at most ~33 passes per filter;
rows with few distinct logits finish in a handful.

Passes per row: greedy and temperature-only rows read the row once (their Gumbel scores are
kept relative to the running maximum, so no ``x / T`` overflows); filtered rows read it once
for the max and normaliser, once per bisection step, once for the top_p mass and once to draw.
Rows holding a NaN or +inf, or no finite logit, get token ``-1`` and logprob NaN (the wrapper
does not look, which would wait for the device; ``sample`` raises on -1).

A program handles ``ROWS`` rows as one ``[ROWS, BLOCK]`` tile, every per-row decision a mask.
On a GPU that is one row per program (each streams its own row, in few registers); in the
CPU interpreter (``TRITON_INTERPRET=1``), which runs programs one after another in Python but
each tile op in numpy, hundreds of rows share a program and a launch of 20,000 rows takes
seconds instead of minutes. So far the kernel has run only under the interpreter; the tests
also compile it for sm_90 (Hopper) without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hotpool.kernels.sampling_pivot_search import any_row, load_tile, survives, threshold

# As in hotpool.kernels.sampling: below this the row is greedy.
_GREEDY_BELOW = 1e-5
_MAX_BLOCK = 1024
# Elements of one [ROWS, BLOCK] tile in the interpreter, where wide tiles are cheap.
_CPU_TILE = 2**17
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _gumbel_scores(shifted, idx, seed, counter, inv_t):
    """``shifted / T`` plus a Gumbel(0, 1) per token; ``shifted`` is ``x - max`` <= 0."""
    # u = 0 (odds 2**-31) would score -inf; a tiny floor keeps the log finite instead.
    u = tl.maximum(tl.rand(seed, counter + idx), 1e-30)
    return shifted * inv_t - tl.log(-tl.log(u))


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
    B,
    V,
    GREEDY_BELOW: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
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
    seed = tl.load(seed_ptr + rows, mask=row_ok, other=0)[:, None]
    counter = (tl.load(offset_ptr + rows, mask=row_ok, other=0) * V)[:, None]
    greedy = (t < GREEDY_BELOW) | (k == 1)
    k_on = (k > 0) & (k < V) & ~greedy
    p_on = (top_p < 1.0) & ~greedy
    filtered = k_on | p_on | ((min_p > 0.0) & ~greedy)
    plain = ~greedy & ~filtered
    inv_t = 1.0 / tl.maximum(t, GREEDY_BELOW)
    any_plain = any_row(plain)

    # Pass 1: raw max and normaliser (online), argmax, smallest finite logit, NaN and +inf,
    # and for temperature-only rows the Gumbel-max draw itself.
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    best = tl.zeros([ROWS], tl.int32)
    xmin = tl.full([ROWS], float("inf"), tl.float32)
    bad = tl.zeros([ROWS], tl.int32)
    score = tl.full([ROWS], float("-inf"), tl.float32)
    token = tl.full([ROWS], -1, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = load_tile(base, idx, row_ok, V)
        bad += tl.sum(((x != x) | (x == float("inf"))).to(tl.int32), axis=1)
        bm = tl.max(x, axis=1)
        best = tl.where(bm > m, start + tl.argmax(x, axis=1), best)  # strict: ties stay
        m_new = tl.maximum(m, bm)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        finite = (x > float("-inf")) & (x < float("inf"))
        xmin = tl.minimum(xmin, tl.min(tl.where(finite, x, float("inf")), axis=1))
        if any_plain:
            # Scores are relative to the running max: move the best so far to the new one.
            score -= tl.where(m > float("-inf"), (m_safe - m) * inv_t, 0.0)
            sc = _gumbel_scores(x - m_safe[:, None], idx, seed, counter, inv_t[:, None])
            sc = tl.where(plain[:, None], sc, float("-inf"))
            bs = tl.max(sc, axis=1)
            won = bs > score
            score = tl.where(won, bs, score)
            token = tl.where(won, start + tl.argmax(sc, axis=1), token)
        m = m_new
    token = tl.where(greedy, best, token)
    # NaN or +inf anywhere, or no finite logit: no distribution to sample (token -1).
    valid = (bad == 0) & (m > float("-inf")) & (m < float("inf"))
    todo = filtered & valid
    if any_row(todo):
        mt = tl.where(valid, m, 0.0)
        vk = xmin
        k_todo = k_on & todo
        if any_row(k_todo):
            lo = tl.where(k_todo, xmin, float("inf"))
            kf = k.to(tl.float32)
            zero = tl.zeros([ROWS], tl.float32)
            found = threshold(
                base, row_ok, V, lo, mt, kf, mt, inv_t, xmin, zero, False, BLOCK, ROWS
            )
            vk = tl.where(k_todo, found, xmin)
        thr = vk
        p_todo = p_on & todo
        if any_row(p_todo):
            # The survivors' mass and smallest logit, where the top_p search starts.
            mass = tl.zeros([ROWS], tl.float32)
            lo = tl.full([ROWS], float("inf"), tl.float32)
            for start in range(0, V, BLOCK):
                x = load_tile(base, start + cols, row_ok, V)
                keep, w = survives(x, mt[:, None], inv_t[:, None], vk[:, None], min_p[:, None])
                mass += tl.sum(tl.where(keep, w, 0.0), axis=1)
                lo = tl.minimum(lo, tl.min(tl.where(keep, x, float("inf")), axis=1))
            lo = tl.where(p_todo, lo, float("inf"))
            found = threshold(
                base, row_ok, V, lo, mt, top_p * mass, mt, inv_t, vk, min_p, True, BLOCK, ROWS
            )
            thr = tl.where(p_todo, found, vk)
        for start in range(0, V, BLOCK):
            idx = start + cols
            x = load_tile(base, idx, row_ok, V)
            keep, _ = survives(x, mt[:, None], inv_t[:, None], thr[:, None], min_p[:, None])
            sc = _gumbel_scores(x - mt[:, None], idx, seed, counter, inv_t[:, None])
            sc = tl.where(keep & todo[:, None], sc, float("-inf"))
            bs = tl.max(sc, axis=1)
            won = bs > score
            score = tl.where(won, bs, score)
            token = tl.where(won, start + tl.argmax(sc, axis=1), token)

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``[B, V]`` and its logprob: ``([B] int64,
    [B] float32)``, on the logits' device, without waiting for it. A row holding NaN or
    +inf, or no finite logit, gets token -1 and logprob NaN.

    Per row: ``temperature`` float32 (< 1e-5: greedy), ``top_k`` int32 (0: off), ``top_p``
    and ``min_p`` float32, ``seeds`` and ``offsets`` int64 (the draw is a function of
    ``(seed, offset)`` and the row alone). Columns must be contiguous; rows may be strided.
    Parameter ranges are the caller's to check (``SamplingRow`` does).
    ``rows_per_program`` (a power of two; None: chosen by device) changes the speed only.
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
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logprobs = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return tokens, logprobs
    block = min(_MAX_BLOCK, triton.next_power_of_2(v))
    rows = rows_per_program or _rows_per_program(b, block, dev.type != "cpu")
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows}")
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
        b,
        v,
        GREEDY_BELOW=_GREEDY_BELOW,
        BLOCK=block,
        ROWS=rows,
    )
    return tokens, logprobs
