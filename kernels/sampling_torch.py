"""The batched torch sampler: the fast path on the CPU, and the path on any device without
Triton. It returns tokens only; ``hotpool.kernels.sampling`` adds logprobs and copies back.

On the CPU, where the C kernels load (``cpu_ops``), the whole batch is sampled in one call
of ``hp_sample``: each row by one thread, from its logits to its token, its weights kept in
the core's cache; no group of rows is gathered and no op is dispatched per filter, which
on a decode step's batch cost more than the passes themselves. A row whose top_p rejection
runs out of uniforms (rare: a small top_p over a flat row) is finished by the torch code
below, with fresh uniforms.

The torch code (where the C kernels do not load, on other devices, for the rows the C call
leaves): rows with ``top_k`` work on its candidates, sorted. Rows without it never sort:
their probabilities are summed in blocks, the uniform picks a block, then a token inside it.
On the CPU their top-p is settled by rejection: a drawn token is kept when the tokens heavier
than it weigh less than ``top_p`` of the total, otherwise the row draws again among the tokens
heavier than the rejected one (FlashInfer's pivot), and after a few rounds finishes with a
sort. Other devices sort those rows at once, so a call never waits for the device. On the CPU
the full-row path's two costliest steps, the scaled softmax and the weight above a pivot, run
in C (``cpu_ops``: one pass each where torch made two or three; where the kernels do not
load, torch runs them).

The grammar's token bitmask goes to the C sampler as it is (it tests the bits itself); the
torch code unpacks it on the logits' device and fills the disallowed tokens of its penalized
copy with -inf, only for a batch that has one.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F

from hotpool.kernels import cpu_ops
from hotpool.kernels.sampling_bitmask import apply_bitmask
from hotpool.kernels.sampling_penalties import apply_penalties
from hotpool.kernels.sampling_random import uniform_draws, uniforms
from hotpool.kernels.sampling_transfer import to_device
from hotpool.kernels.sampling_types import SamplingRow

# Devices where rows may be inspected between steps at no cost (the rejection loop reads
# whether every row is settled); elsewhere that read would wait for the device.
_REJECTION_DEVICES = ("cpu",)
# Rows still unsettled after this many rejection rounds are sampled through a full sort.
_MAX_REJECTION_ROUNDS = 6
# Uniforms a row takes into the C sampler: the draw's, then one per top_p rejection round.
_NATIVE_DRAWS = 4
# Long rows are reduced in blocks of this many columns before a search inside one block.
_BLOCK = 256
_TOPK_BLOCK = 128
# Logits up to this times the temperature divide by it without overflow, and softmax then
# subtracts the row's max itself.
_SCALE_SAFE = 1e37


def torch_sample_tokens(
    raw: torch.Tensor,
    rows: Sequence[SamplingRow],
    generators: Sequence[torch.Generator | None],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token ``[B]`` int64 per row of the float32 logits ``raw``, on its device, each
    row's penalties applied first (to a copy: ``raw`` is left as it is), then the grammar's
    token bitmask ``mask`` (int32 ``[B, (V + 31) // 32]`` on ``raw``'s device, or None):
    a masked row whose allowed logits are all -inf gets token -1. ``generators``: each
    row's, None for torch's default generator."""
    native = _native(raw)
    # A batch of greedy rows without penalties is quicker through argmax alone, unless it
    # has a mask: the C sampler applies that without an unpacked copy.
    if native is not None and (
        mask is not None or not all(r.greedy and not r.has_penalty for r in rows)
    ):
        return _sample_native(native, raw, rows, generators, mask)
    return sample_penalized(raw, rows, generators, mask)


def sample_penalized(
    raw: torch.Tensor,
    rows: Sequence[SamplingRow],
    generators: Sequence[torch.Generator | None],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch code's tokens for ``raw`` with the rows' penalties, then ``mask``, applied
    (to a copy), -1 for a masked row whose allowed logits are all -inf."""
    x = apply_penalties(raw, rows) if any(r.has_penalty for r in rows) else raw
    if mask is None:
        return _sample_torch(x, rows, generators)
    x = apply_bitmask(x, mask)
    # Off the CPU this is read with the results, never waited for here.
    return torch.where(torch.isfinite(x.amax(dim=1)), _sample_torch(x, rows, generators), -1)


def _sample_native(
    native: cpu_ops.CpuOps,
    x: torch.Tensor,
    rows: Sequence[SamplingRow],
    generators: Sequence[torch.Generator | None],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    b, v = x.shape
    need = [0 if r.greedy else _NATIVE_DRAWS if r.top_p < 1.0 else 1 for r in rows]
    drawn = iter(uniform_draws(generators, need))
    # Built with array (C loops over Python numbers), one tensor each: every torch op costs
    # microseconds of dispatch, more when a forward pass has just pushed its code out of cache.
    table = array("f", [next(drawn) if j < n else 0.0 for n in need for j in range(_NATIVE_DRAWS)])
    params = array("f", [0.0 if r.greedy else r.temperature for r in rows])
    params.extend([r.top_p for r in rows])
    params.extend([r.min_p for r in rows])
    floats = torch.frombuffer(params, dtype=torch.float32).view(3, b)
    tokens, status, unsettled = native.sample(
        x.contiguous(),
        floats[0],
        torch.frombuffer(array("q", [r.top_k if 0 < r.top_k < v else 0 for r in rows]),
                         dtype=torch.int64),
        floats[1],
        floats[2],
        torch.frombuffer(table, dtype=torch.float32).view(b, _NATIVE_DRAWS),
        _penalties(rows, v) if any(r.has_penalty for r in rows) else None,
        mask,
    )  # fmt: skip
    if unsettled:  # rejected at every draw: finished exactly, with fresh uniforms
        left = status.nonzero().squeeze(1)
        idx = left.tolist()
        sub = [rows[i] for i in idx]
        tokens[left] = sample_penalized(
            x.index_select(0, left),
            sub,
            [generators[i] for i in idx],
            None if mask is None else mask.index_select(0, left),
        )
    return tokens


def _penalties(rows: Sequence[SamplingRow], v: int) -> cpu_ops.Penalties:
    """The rows' penalties as the C sampler takes them: the prompt's tokens where a row has a
    repetition penalty, the output's where it has any."""
    parts: list[Sequence[int]] = []
    offsets: list[int] = []
    n = 0
    for r in rows:
        offsets.append(n)
        if r.repetition_penalty != 1.0:
            parts.append(r.prompt_token_ids)
            n += len(r.prompt_token_ids)
        offsets.append(n)
        if r.has_penalty:
            parts.append(r.output_token_ids)
            n += len(r.output_token_ids)
        offsets.append(n)
    ids = np.fromiter(chain.from_iterable(parts), dtype=np.int64, count=n)
    values = array("f", [r.repetition_penalty for r in rows])
    values.extend([r.presence_penalty for r in rows])
    values.extend([r.frequency_penalty for r in rows])
    each = torch.frombuffer(values, dtype=torch.float32).view(3, len(rows))
    return cpu_ops.Penalties(
        torch.from_numpy(ids),
        torch.frombuffer(array("q", offsets), dtype=torch.int64).view(len(rows), 3),
        each[0],
        each[1],
        each[2],
    )


def _sample_torch(
    x: torch.Tensor, rows: Sequence[SamplingRow], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    b, v = x.shape
    greedy: list[int] = []
    full: list[int] = []  # no top_k: the whole row, unsorted
    ranked: list[int] = []  # top_k: topk's candidates
    nucleus: list[int] = []  # no top_k but top_p, off the rejection devices: full sort
    for i, r in enumerate(rows):
        if r.greedy:
            greedy.append(i)
        elif 0 < r.top_k < v:
            ranked.append(i)
        elif r.top_p < 1.0 and x.device.type not in _REJECTION_DEVICES:
            nucleus.append(i)
        else:
            full.append(i)
    if len(greedy) == b:
        return argmax(x)

    tokens = torch.empty(b, dtype=torch.long, device=x.device)
    drawn = sorted(full + ranked + nucleus)
    uniform = dict(zip(drawn, uniforms([generators[i] for i in drawn]), strict=True))
    for idx, pick in (
        (greedy, None),
        (full, _sample_full),
        (ranked, _sample_ranked),
        (nucleus, _sample_ranked),
    ):
        if not idx:
            continue
        where = to_device(torch.tensor(idx), x.device)
        sub = x if len(idx) == b else x.index_select(0, where)
        if pick is None:
            out = argmax(sub)
        else:
            group, gens = [rows[i] for i in idx], [generators[i] for i in idx]
            out = pick(sub, _params(group, gens, [uniform[i] for i in idx], v, x.device))
        tokens.index_copy_(0, where, out)
    return tokens


@dataclass(frozen=True)
class _Params:
    """One group's per-row parameters: columns ``[R, 1]`` on the logits' device."""

    temperature: torch.Tensor
    min_p: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor  # float; V where off
    uniform: torch.Tensor
    k: int  # the largest top_k, V where any row has none: how many candidates to rank
    generators: list[torch.Generator | None]
    all_unit_temperature: bool
    any_min_p: bool
    any_top_p: bool


def _params(
    rows: list[SamplingRow],
    generators: list[torch.Generator | None],
    uniform: list[float],
    v: int,
    dev: torch.device,
) -> _Params:
    top_k = [r.top_k if 0 < r.top_k < v else v for r in rows]
    table = torch.tensor(
        [
            [r.temperature, r.min_p, r.top_p, float(k), u]
            for r, k, u in zip(rows, top_k, uniform, strict=True)
        ],
        dtype=torch.float32,
    )
    cols = to_device(table, dev).unsqueeze(2).unbind(1)
    return _Params(
        *cols,
        k=max(top_k),
        generators=generators,
        all_unit_temperature=all(r.temperature == 1.0 for r in rows),
        any_min_p=any(r.min_p > 0.0 for r in rows),
        any_top_p=any(r.top_p < 1.0 for r in rows),
    )


def _sample_ranked(x: torch.Tensor, p: _Params) -> torch.Tensor:
    """Sample among each row's ``p.k`` largest logits, sorted (all of them when k = V)."""
    values, ids = topk(x, p.k)  # sorted, descending
    w = values.sub(values[:, :1]).div_(p.temperature).exp_()  # the largest weighs 1
    rank = torch.arange(w.shape[1], device=w.device)
    w.masked_fill_((rank >= p.top_k) | (w < p.min_p), 0.0)
    cdf = w.cumsum(dim=1)
    return _sample_prefix(cdf, ids, cdf[:, -1:] * p.top_p, p.uniform)


def _sample_prefix(
    cdf: torch.Tensor, ids: torch.Tensor, target: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Sample from the cumulative weights of tokens sorted descending, cut at ``target``.

    The token where the cumulative weight first reaches ``target`` (top_p of the total) is
    the last one kept; every token after it is cut.
    """
    last = torch.searchsorted(cdf, target).clamp_(max=cdf.shape[1] - 1)
    return ids.gather(1, _search(cdf, cdf.gather(1, last), u)).squeeze(1)


def _search(cdf: torch.Tensor, limit: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Positions ``[R, 1]`` drawn with weights ``cdf``'s increments, up to ``limit``."""
    # The clamp only matters for rows holding NaN (sampled, off the CPU, before ``sample``
    # reports them): their index must stay inside the row.
    pos = torch.searchsorted(cdf, _below(u * limit, limit), right=True)
    return pos.clamp_(max=cdf.shape[1] - 1)


def _below(target: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``target`` kept under ``limit`` (``u * limit`` can round up to it).

    Searching for the first cdf entry above a target under the cdf's last value lands on a
    token with positive weight: never one a filter zeroed, never past the end.
    """
    return torch.minimum(target, torch.nextafter(limit, torch.zeros_like(limit)))


def _blocks(t: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``t`` ``[R, V]`` reduced over blocks of ``_BLOCK`` columns (the last one may be short)."""
    r, v = t.shape
    n = v // _BLOCK * _BLOCK
    parts = [reduce(t[:, :n].reshape(r, -1, _BLOCK), dim=2)] if n else []
    if n < v:
        parts.append(reduce(t[:, n:], dim=1, keepdim=True))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _block_columns(t: torch.Tensor, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The column ids ``[R, _BLOCK]`` of each row's ``block`` and whether each exists."""
    cols = block * _BLOCK + torch.arange(_BLOCK, device=t.device)
    return cols.clamp(max=t.shape[1] - 1), cols < t.shape[1]


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=1)``, sorted; for a small ``k``, among the ``k`` blocks with
    the largest maxima only (a value outside them has k larger ones, those maxima)."""
    r, v = x.shape
    if k * _TOPK_BLOCK * 4 > v:
        values, ids = torch.topk(x, k, dim=1)
        return values, ids
    n = v // _TOPK_BLOCK * _TOPK_BLOCK
    blocks = x[:, :n].reshape(r, -1, _TOPK_BLOCK).amax(dim=2).topk(k, dim=1, sorted=False)
    cols = blocks.indices[:, :, None] * _TOPK_BLOCK + torch.arange(_TOPK_BLOCK, device=x.device)
    cols = cols.reshape(r, -1)
    if n < v:  # the short last block is always a candidate
        cols = torch.cat([cols, torch.arange(n, v, device=x.device).expand(r, -1)], dim=1)
    values, pos = x.gather(1, cols).topk(k, dim=1)
    return values, cols.gather(1, pos)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=1)`` (the first largest), through the block maxima: on this CPU
    ``amax`` is an order of magnitude faster than ``argmax`` over a long row."""
    block = _blocks(x, torch.amax).argmax(dim=1, keepdim=True)
    cols, _ = _block_columns(x, block)  # a short last block repeats column V - 1
    return cols.gather(1, x.gather(1, cols).argmax(dim=1, keepdim=True)).squeeze(1)


def _draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One position ``[R, 1]`` per row with probability proportional to ``w`` >= 0.

    The inverse of the cumulative weight at ``u * total``, found in two levels so that the
    row is read once: the cumulative block sums pick the block, a cumulative sum over that
    block alone picks the token.
    """
    block_cdf = _blocks(w, torch.sum).cumsum(dim=1)
    target = _below(u * block_cdf[:, -1:], block_cdf[:, -1:])
    block = torch.searchsorted(block_cdf, target, right=True)  # a block with weight
    block.clamp_(max=block_cdf.shape[1] - 1)  # NaN rows only, as in `_search`
    before = block_cdf.gather(1, (block - 1).clamp(min=0)) * (block > 0)
    cols, exists = _block_columns(w, block)
    cdf = (w.gather(1, cols) * exists).cumsum(dim=1)
    # the block's own sum may round apart from the block sums' difference: stay inside it
    pos = torch.searchsorted(cdf, _below(target - before, cdf[:, -1:]), right=True)
    return cols.gather(1, pos.clamp_(max=_BLOCK - 1))


def _sample_full(x: torch.Tensor, p: _Params) -> torch.Tensor:
    """Sample rows without top_k over the whole row, unsorted; top-p by rejection."""
    native = _native(x)
    if native is not None:  # one pass for max, one for exp and sum, one to normalise
        w = native.softmax_t(x.contiguous(), p.temperature)
    else:
        w = torch.softmax(x if p.all_unit_temperature else _scaled(x, p.temperature), dim=1)
    if p.any_min_p:  # keep w >= min_p * max, by arithmetic: masks are slow on the CPU
        cut = torch.nextafter(p.min_p * w.amax(dim=1, keepdim=True), torch.zeros_like(p.min_p))
        w.mul_((w - cut).clamp_(min=0.0).sign_())
    tokens = _draw(w, p.uniform)
    if p.any_top_p:
        _settle_nucleus(w, tokens, w.sum(dim=1, keepdim=True) * p.top_p, p, native)
    return tokens.squeeze(1)


def _native(x: torch.Tensor) -> cpu_ops.CpuOps | None:
    """The C kernels, for float32 CPU rows where they load."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return cpu_ops.load()


def _scaled(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``x / temperature``, shifted by each row's max first where that division could
    overflow (a huge logit over a small temperature). On the CPU the max is cheap and read
    at once; elsewhere reading it would wait for the device, so rows are always shifted."""
    top = x.amax(dim=1, keepdim=True)
    if x.device.type != "cpu" or bool((top.abs() > _SCALE_SAFE * temperature).any()):
        return x.sub(top).div_(temperature)
    return x / temperature


def _settle_nucleus(
    w: torch.Tensor,
    tokens: torch.Tensor,
    target: torch.Tensor,
    p: _Params,
    native: cpu_ops.CpuOps | None = None,
) -> None:
    """Redraw, in place, the rows of ``tokens`` ``[R, 1]`` that fell outside the nucleus.

    A token is in the nucleus when the tokens heavier than it weigh less than ``target``.
    A rejected row redraws among the tokens heavier than the rejected one (all lighter ones
    are outside the nucleus too). Whatever the proposal, a draw that lands in the nucleus
    follows the nucleus's own distribution, so the accepted draw is exact.
    """
    pending = (p.top_p < 1.0).squeeze(1).nonzero().squeeze(1)
    wp = w if pending.numel() == w.shape[0] else w[pending]
    for round_ in range(_MAX_REJECTION_ROUNDS + 1):
        pivot = wp.gather(1, tokens[pending])
        if native is not None:  # one pass, and exact (no division by the pivot)
            heavier = native.sum_above(wp, pivot)
        else:  # the weight above the pivot, scaled by it: `threshold` is far cheaper than `where`
            heavier = F.threshold(wp / pivot, 1.0, 0.0).sum(dim=1, keepdim=True) * pivot
        rejected = (heavier >= target[pending]).squeeze(1)
        if not rejected.any():
            return
        pending, wp, pivot = pending[rejected], wp[rejected], pivot[rejected]
        wp = torch.where(wp > pivot, wp, 0.0)
        u = torch.tensor(uniforms([p.generators[i] for i in pending.tolist()]))[:, None]
        if round_ == _MAX_REJECTION_ROUNDS:
            break
        tokens[pending] = _draw(wp, u)
    # Rare (a tiny top_p over a flat row): finish those rows exactly with a sort. Pivoting
    # dropped only tokens outside the nucleus, so the same target still cuts it.
    sorted_w, ids = wp.sort(dim=1, descending=True)
    tokens[pending] = _sample_prefix(sorted_w.cumsum(dim=1), ids, target[pending], u)[:, None]
