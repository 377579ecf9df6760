"""Turn a batch of logits into tokens: batched torch sampling for the CPU and any torch device.

Each row carries its own parameters (``SamplingRow``). ``sample`` applies them in this order:

1. **Penalties**, on the logits. Repetition (vLLM/HF): every token of the prompt or the
   output has a positive logit divided by ``repetition_penalty`` and a negative one
   multiplied. Then presence and frequency (OpenAI): over the output tokens,
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
2. **Logprobs** are taken from the model's RAW logits: ``log_softmax`` before penalties and
   temperature, for the sampled token and the top-N (what OpenAI's API reports).
3. **Temperature**. Below 1e-5 (0 included), and with ``top_k == 1``, the row is greedy: the
   argmax of the penalized logits, whatever its other filters.
4. **min_p**: drop tokens whose probability is below ``min_p`` times the largest one.
5. **top_k**.
6. **top_p** over the survivors of 4-5, renormalized; the token that crosses ``top_p``
   stays in.
7. **Draw**: one uniform number per row, looked up in the cumulative weights of the kept
   tokens (the same distribution as ``multinomial``, at a fraction of its cost).

Every path is exact in distribution. Rows with ``top_k`` work on its candidates, sorted.
Rows without it never sort: their probabilities are summed in blocks, the uniform picks a
block, then a token inside it. On the CPU their top-p is settled by rejection: a drawn token
is kept when the tokens heavier than it weigh less than ``top_p`` of the total, otherwise
the row draws again among the tokens heavier than the rejected one (FlashInfer's pivot),
and after a few rounds finishes with a sort. Other devices sort those rows at once, so
a call never waits for the device but once, to copy the results to the host.

A seeded row draws its uniforms from its own ``generator`` (a CPU ``torch.Generator``), so
its tokens do not depend on the rest of the batch; other rows share torch's default
generator. The fused Triton kernel (issue 4) will sit behind ``sample``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F

# Devices where rows may be inspected between steps at no cost (the rejection loop reads
# whether every row is settled); elsewhere that read would wait for the device.
_REJECTION_DEVICES = ("cpu",)
# Rows still unsettled after this many rejection rounds are sampled through a full sort.
_MAX_REJECTION_ROUNDS = 6
# Temperatures below this are greedy, as in vLLM: the distribution is the argmax's to within
# float precision, and dividing by them can overflow.
_GREEDY_BELOW = 1e-5
# Long rows are reduced in blocks of this many columns before a search inside one block.
_BLOCK = 256
_TOPK_BLOCK = 128


@dataclass(frozen=True)
class SamplingRow:
    """One request's sampling parameters for one step."""

    temperature: float = 1.0  # 0 (below 1e-5): greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    generator: torch.Generator | None = None  # a CPU generator for seeded requests
    num_logprobs: int = 0  # top-N logprobs wanted at the sampled position
    prompt_token_ids: Sequence[int] = ()  # for repetition_penalty
    output_token_ids: Sequence[int] = ()  # for every penalty

    def __post_init__(self) -> None:
        # `not x >= 0` also catches NaN.
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not (math.isfinite(self.presence_penalty) and math.isfinite(self.frequency_penalty)):
            raise ValueError("presence_penalty and frequency_penalty must be finite")
        if self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be >= 0, got {self.num_logprobs}")
        if self.generator is not None and self.generator.device.type != "cpu":
            raise ValueError("generator must be a CPU torch.Generator")

    @property
    def has_penalty(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class SamplerOutput:
    """What ``sample`` returns, on the CPU."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: raw logprob of the sampled token
    # ([B, N] float32 raw logprobs sorted descending, [B, N] int64 ids) for N = the largest
    # num_logprobs in the batch (at most V), or None when no row asked.
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    """Sample one token per row of ``logits`` ``[B, V]`` (fp32/bf16/fp16, any device)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] == 0:
        raise ValueError(f"logits {tuple(logits.shape)} are not [{len(rows)} rows, V > 0]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    raw = logits.float()
    b, v = raw.shape
    x = _apply_penalties(raw, rows) if any(r.has_penalty for r in rows) else raw

    greedy: list[int] = []
    full: list[int] = []  # no top_k: the whole row, unsorted
    ranked: list[int] = []  # top_k: topk's candidates
    nucleus: list[int] = []  # no top_k but top_p, off the rejection devices: full sort
    for i, r in enumerate(rows):
        if r.temperature < _GREEDY_BELOW or r.top_k == 1:
            greedy.append(i)
        elif 0 < r.top_k < v:
            ranked.append(i)
        elif r.top_p < 1.0 and raw.device.type not in _REJECTION_DEVICES:
            nucleus.append(i)
        else:
            full.append(i)

    if len(greedy) == b:
        tokens = _argmax(x)
    else:
        tokens = torch.empty(b, dtype=torch.long, device=x.device)
        drawn = sorted(full + ranked + nucleus)
        uniform = dict(zip(drawn, _uniforms([rows[i].generator for i in drawn]), strict=True))
        for idx, pick in (
            (greedy, None),
            (full, _sample_full),
            (ranked, _sample_ranked),
            (nucleus, _sample_ranked),
        ):
            if not idx:
                continue
            where = _to_device(torch.tensor(idx), x.device)
            sub = x if len(idx) == b else x.index_select(0, where)
            if pick is None:
                out = _argmax(sub)
            else:
                group = [rows[i] for i in idx]
                out = pick(sub, _params(group, [uniform[i] for i in idx], v, x.device))
            tokens.index_copy_(0, where, out)

    raw_logprobs = torch.log_softmax(raw, dim=1)
    n = min(max(r.num_logprobs for r in rows), v) if b else 0
    top = _topk(raw_logprobs, n) if n else None
    logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
    return _to_host(tokens, logprobs, top)


def _apply_penalties(raw: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """A penalized copy of ``raw``, touching only the (row, token) pairs that occurred.

    A pair may repeat: each assignment computes every value from the logits before it, so
    repeats write the same value, while frequency's ``index_add_`` counts every occurrence.
    """
    v = raw.shape[1]
    x = raw.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    flat = x.view(-1)
    rep = [i for i, r in enumerate(rows) if r.repetition_penalty != 1.0]
    pos, row = _flat_ids(
        [(i, ids) for i in rep for ids in (rows[i].prompt_token_ids, rows[i].output_token_ids)],
        v,
    )
    if row.numel():
        penalty = torch.tensor([r.repetition_penalty for r in rows], dtype=torch.float32)[row]
        pos, penalty = _to_device(pos, x.device), _to_device(penalty, x.device)
        values = flat[pos]
        flat[pos] = torch.where(values > 0, values / penalty, values * penalty)
    said = [i for i, r in enumerate(rows) if r.presence_penalty or r.frequency_penalty]
    pos, row = _flat_ids([(i, rows[i].output_token_ids) for i in said], v)
    if row.numel():
        presence = torch.tensor([r.presence_penalty for r in rows], dtype=torch.float32)[row]
        frequency = torch.tensor([r.frequency_penalty for r in rows], dtype=torch.float32)[row]
        pos = _to_device(pos, x.device)
        flat[pos] = flat[pos] - _to_device(presence, x.device)
        flat.index_add_(0, pos, _to_device(-frequency, x.device))
    return x


def _flat_ids(pairs: list[tuple[int, Sequence[int]]], v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``row * v + token`` and ``row`` for every token of the (row, token ids) pairs, on
    the CPU."""
    lengths = torch.tensor([len(ids) for _, ids in pairs], dtype=torch.long)
    total = int(lengths.sum())
    ids = torch.from_numpy(
        np.fromiter(chain.from_iterable(ids for _, ids in pairs), dtype=np.int64, count=total)
    )
    if total and (int(ids.min()) < 0 or int(ids.max()) >= v):
        raise ValueError(f"penalty token ids must be in [0, {v})")
    row = torch.tensor([i for i, _ in pairs], dtype=torch.long).repeat_interleave(lengths)
    return row * v + ids, row


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


def _params(rows: list[SamplingRow], uniform: list[float], v: int, dev: torch.device) -> _Params:
    top_k = [r.top_k if 0 < r.top_k < v else v for r in rows]
    table = torch.tensor(
        [
            [r.temperature, r.min_p, r.top_p, float(k), u]
            for r, k, u in zip(rows, top_k, uniform, strict=True)
        ],
        dtype=torch.float32,
    )
    cols = _to_device(table, dev).unsqueeze(2).unbind(1)
    return _Params(
        *cols,
        k=max(top_k),
        generators=[r.generator for r in rows],
        all_unit_temperature=all(r.temperature == 1.0 for r in rows),
        any_min_p=any(r.min_p > 0.0 for r in rows),
        any_top_p=any(r.top_p < 1.0 for r in rows),
    )


def _sample_ranked(x: torch.Tensor, p: _Params) -> torch.Tensor:
    """Sample among each row's ``p.k`` largest logits, sorted (all of them when k = V)."""
    values, ids = _topk(x, p.k)  # sorted, descending
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
    return torch.searchsorted(cdf, _below(u * limit, limit), right=True)


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


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def _argmax(x: torch.Tensor) -> torch.Tensor:
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
    before = block_cdf.gather(1, (block - 1).clamp(min=0)) * (block > 0)
    cols, exists = _block_columns(w, block)
    cdf = (w.gather(1, cols) * exists).cumsum(dim=1)
    # the block's own sum may round apart from the block sums' difference: stay inside it
    pos = torch.searchsorted(cdf, _below(target - before, cdf[:, -1:]), right=True)
    return cols.gather(1, pos)


def _sample_full(x: torch.Tensor, p: _Params) -> torch.Tensor:
    """Sample rows without top_k over the whole row, unsorted; top-p by rejection."""
    w = torch.softmax(x if p.all_unit_temperature else x / p.temperature, dim=1)
    if p.any_min_p:  # keep w >= min_p * max, by arithmetic: masks are slow on the CPU
        cut = torch.nextafter(p.min_p * w.amax(dim=1, keepdim=True), torch.zeros_like(p.min_p))
        w.mul_((w - cut).clamp_(min=0.0).sign_())
    tokens = _draw(w, p.uniform)
    if p.any_top_p:
        _settle_nucleus(w, tokens, w.sum(dim=1, keepdim=True) * p.top_p, p)
    return tokens.squeeze(1)


def _settle_nucleus(
    w: torch.Tensor, tokens: torch.Tensor, target: torch.Tensor, p: _Params
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
        # the weight above the pivot, scaled by it: `threshold` is far cheaper than `where`
        heavier = F.threshold(wp / pivot, 1.0, 0.0).sum(dim=1, keepdim=True) * pivot
        rejected = (heavier >= target[pending]).squeeze(1)
        if not rejected.any():
            return
        pending, wp, pivot = pending[rejected], wp[rejected], pivot[rejected]
        wp = torch.where(wp > pivot, wp, 0.0)
        u = torch.tensor(_uniforms([p.generators[i] for i in pending.tolist()]))[:, None]
        if round_ == _MAX_REJECTION_ROUNDS:
            break
        tokens[pending] = _draw(wp, u)
    # Rare (a tiny top_p over a flat row): finish those rows exactly with a sort. Pivoting
    # dropped only tokens outside the nucleus, so the same target still cuts it.
    sorted_w, ids = wp.sort(dim=1, descending=True)
    tokens[pending] = _sample_prefix(sorted_w.cumsum(dim=1), ids, target[pending], u)[:, None]


def _uniforms(generators: Sequence[torch.Generator | None]) -> list[float]:
    """One uniform in [0, 1) per row: from the row's own generator, else torch's default."""
    shared = iter(torch.rand(sum(g is None for g in generators)).tolist())
    return [next(shared) if g is None else torch.rand(1, generator=g).item() for g in generators]


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    if dev.type == "cpu":
        return t
    # Pinned memory lets the copy run asynchronously instead of waiting for the device.
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


def _to_host(
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    top: tuple[torch.Tensor, torch.Tensor] | None,
) -> SamplerOutput:
    if tokens.device.type == "cpu":
        return SamplerOutput(tokens, logprobs, top)
    return _unpack(_pack(tokens, logprobs, top).cpu(), 0 if top is None else top[0].shape[1])


def _pack(
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    top: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Every result in one int64 tensor, float32s by their bits, for a single host copy."""
    parts = [tokens[:, None], logprobs.view(torch.int32).long()[:, None]]
    if top is not None:
        parts += [top[0].contiguous().view(torch.int32).long(), top[1]]
    return torch.cat(parts, dim=1)


def _unpack(packed: torch.Tensor, n: int) -> SamplerOutput:
    def floats(cols: torch.Tensor) -> torch.Tensor:
        return cols.to(torch.int32).contiguous().view(torch.float32)

    top = (floats(packed[:, 2 : 2 + n]), packed[:, 2 + n :].contiguous()) if n else None
    return SamplerOutput(packed[:, 0].contiguous(), floats(packed[:, 1]), top)
