"""Verify proposed tokens against the target model: keep the longest prefix it agrees with,
then emit one token of its own, so a step emits 1 to k + 1 tokens.

The target model runs once over the request's last token and its ``k`` proposed tokens,
giving logits at ``k + 1`` positions: position ``j`` is the distribution of the token after
draft ``j - 1`` (position 0: after the last real token). Each position's logits become the
distribution ``p_j`` the sampler would draw from there, by the sampler's own rules
(``hotpool.kernels.sampling_reference.reference_probs``: penalties, grammar mask,
temperature, min_p, top_k, top_p), the penalties counting the drafts before ``j`` as
output.

- Greedy rows (``SamplingRow.greedy``) accept draft ``j`` while it is the argmax of
  ``p_j``, then emit the argmax at the first disagreement (or the bonus position ``k``):
  exactly the tokens greedy decoding without speculation gives from the same logits.
- Sampled rows use speculative rejection sampling (Leviathan et al. 2023, Chen et al.
  2023): draft ``x_j``, drawn from the proposer's ``q_j``, is accepted with probability
  ``min(1, p_j(x) / q_j(x))``; at the first rejection the emitted token is drawn from
  ``normalize(max(0, p_j - q_j))``; if every draft is accepted the bonus token is drawn from
  ``p_k``. Every emitted token is then distributed as the target alone would draw it. A
  deterministic proposer (n-gram lookup) passes no ``q``: it is one-hot on the draft, so
  ``x`` is accepted with probability ``p_j(x)`` and a rejection draws from ``p_j`` without
  ``x``.

Randomness: a sampled row draws exactly ``k + 1`` uniforms from its generator per call (one
per acceptance test, one for the emitted token), whatever is accepted; a greedy row draws
none. So a seeded generator reproduces a row's tokens, and ``verify_batch`` gives each row
its generator by the sampler's rules (``hotpool.kernels.sampling_random.row_generators``).

One row at a time, in float64 on the CPU: correct first; a batched device path can be held
to this one later, as the sampler's paths are to its reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from hotpool.kernels.sampling_random import row_generators
from hotpool.kernels.sampling_reference import penalize, reference_probs
from hotpool.kernels.sampling_types import NonFiniteLogitsError, SamplingRow


def verify(
    target_logits: torch.Tensor,
    draft_tokens: Sequence[int] | torch.Tensor,
    draft_probs: torch.Tensor | None,
    row: SamplingRow,
    generator: torch.Generator | None = None,
    allowed: torch.Tensor | None = None,
) -> list[int]:
    """The tokens one row emits: the accepted drafts, then one more (1 to k + 1 tokens).

    ``target_logits``: ``[k + 1, V]`` raw logits of the target at the k + 1 positions, any
    float dtype and device. ``draft_tokens``: the k proposed ids. ``draft_probs``: ``[k,
    V]``, the distribution each draft was drawn from (a draft model's, after its own
    filters), or None for a deterministic proposer. ``row``: the request's sampling
    parameters; its ``output_token_ids`` are the output before this step (for penalties).
    ``generator``: a CPU generator for every draw (None: torch's default). ``allowed``:
    bool ``[k + 1, V]``, the grammar's allowed tokens at each position, or None.

    Raises ``NonFiniteLogitsError`` naming the positions whose logits hold no distribution,
    before drawing anything; ValueError for inconsistent shapes or ids, or a draft its own
    ``q`` gives probability 0.
    """
    drafts = _draft_list(draft_tokens)
    logits = _checked(target_logits, len(drafts), draft_probs, allowed, drafts)
    bad = _bad_positions(logits, allowed)
    if bad:
        raise NonFiniteLogitsError(bad)
    return _verify_checked(logits, drafts, draft_probs, row, generator, allowed)


def _verify_checked(
    logits: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    row: SamplingRow,
    generator: torch.Generator | None,
    allowed: torch.Tensor | None,
) -> list[int]:
    """``verify`` once the logits are known to hold a distribution at every position."""
    rows = _position_rows(row, drafts)
    masks = [None if allowed is None else allowed[j].cpu() for j in range(len(rows))]
    if row.greedy:
        return _verify_greedy(logits, drafts, rows, masks)
    probs = torch.stack(
        [reference_probs(x, r, m) for x, r, m in zip(logits, rows, masks, strict=True)]
    )
    q = None if draft_probs is None else draft_probs.detach().double().cpu()
    return accept(probs, drafts, q, generator)


def accept(
    probs: torch.Tensor,
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Rejection sampling on the target's processed distributions ``probs`` ``[k + 1, V]``
    (rows summing to 1): the accepted drafts, then the resampled or bonus token. Draws
    exactly k + 1 uniforms. ``draft_probs``: ``[k, V]`` (each row renormalized here) or
    None (one-hot on the drafts)."""
    k = len(draft_tokens)
    u = torch.rand(k + 1, generator=generator, dtype=torch.float64).tolist()
    if not k:
        return [_draw(probs[0], u[0])]
    v = probs.shape[1]
    # Every ratio's terms in one read per distribution, not one per draft.
    flat = torch.tensor([j * v + x for j, x in enumerate(draft_tokens)])
    px = probs.reshape(-1).index_select(0, flat).tolist()
    q = None
    if draft_probs is None:
        qx = [1.0] * k
    else:
        q = draft_probs / draft_probs.sum(dim=1, keepdim=True)
        qx = q.reshape(-1).index_select(0, flat).tolist()
        if not min(qx) > 0.0:
            j = next(j for j, v in enumerate(qx) if not v > 0.0)
            raise ValueError(f"draft {j} (token {draft_tokens[j]}) has probability 0 under its q")
    for j, x in enumerate(draft_tokens):
        if u[j] * qx[j] < px[j]:  # u < p(x) / q(x): accepted with probability min(1, p/q)
            continue
        p = probs[j]
        if q is None:
            residual = p.clone()
            residual[x] = 0.0  # max(0, p - onehot(x))
        else:
            residual = (p - q[j]).clamp(min=0.0)
        # Positive whenever a rejection can happen (p(x) < q(x) means p > q elsewhere);
        # rounding alone could empty it, and then p is the right fallback.
        if not float(residual.sum()) > 0.0:
            residual = p
        return [*draft_tokens[:j], _draw(residual, u[k])]
    return [*draft_tokens, _draw(probs[k], u[k])]


def verify_batch(
    target_logits: torch.Tensor,
    draft_tokens: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None] | None,
    rows: Sequence[SamplingRow],
    allowed: torch.Tensor | None = None,
) -> list[list[int]]:
    """``verify`` for a batch: row ``i`` owns ``len(draft_tokens[i]) + 1`` consecutive rows
    of ``target_logits`` (and of ``allowed``), in order. Each row draws from its generator
    by the sampler's rules (its own, else one seeded by ``(seed, offset)``, else torch's
    default). Raises ``NonFiniteLogitsError`` naming the batch rows (not positions) whose
    logits hold no distribution, before any row draws, so the caller can drop them and
    call again."""
    if len(draft_tokens) != len(rows) or (
        draft_probs is not None and len(draft_probs) != len(rows)
    ):
        raise ValueError("draft_tokens, draft_probs and rows must have one entry per row")
    spans = [len(d) + 1 for d in draft_tokens]
    if target_logits.dim() != 2 or target_logits.shape[0] != sum(spans):
        raise ValueError(
            f"target_logits {tuple(target_logits.shape)} are not [{sum(spans)} positions, V]"
        )
    logits = target_logits.detach().float().cpu()
    per_position = _bad_positions(logits, None if allowed is None else allowed.cpu())
    if per_position:
        owner = [i for i, n in enumerate(spans) for _ in range(n)]
        raise NonFiniteLogitsError(sorted({owner[j] for j in per_position}))
    out = []
    start = 0
    for i, (row, gen) in enumerate(zip(rows, row_generators(rows), strict=True)):
        span = slice(start, start + spans[i])
        drafts = _draft_list(draft_tokens[i])
        probs = None if draft_probs is None else draft_probs[i]
        mask = None if allowed is None else allowed[span]
        _checked(logits[span], len(drafts), probs, mask, drafts)
        out.append(_verify_checked(logits[span], drafts, probs, row, gen, mask))
        start += spans[i]
    return out


def _verify_greedy(
    logits: torch.Tensor,
    drafts: list[int],
    rows: list[SamplingRow],
    masks: list[torch.Tensor | None],
) -> list[int]:
    if rows[0].has_penalty or masks[0] is not None:
        x = torch.stack([penalize(x, r) for x, r in zip(logits, rows, strict=True)])
        if masks[0] is not None:
            x[~torch.stack(masks)] = float("-inf")
    else:
        x = logits
    best = x.argmax(dim=1).tolist()  # the first of the largest, as the sampler's greedy
    out = []
    for j, d in enumerate(drafts):
        if d != best[j]:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def _position_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """The row at each of the k + 1 positions: position j's penalties count drafts [0, j)
    as output, as they would be had the target sampled them. Without penalties the token
    lists are dropped (``penalize`` would still walk them)."""
    if not row.has_penalty:
        base = replace(row, prompt_token_ids=(), output_token_ids=())
        return [base] * (len(drafts) + 1)
    out = tuple(row.output_token_ids)
    return [replace(row, output_token_ids=out + tuple(drafts[:j])) for j in range(len(drafts) + 1)]


def _draw(weights: torch.Tensor, u: float) -> int:
    """The first token whose cumulative weight exceeds ``u`` of the total (the sampler's
    step 7). That token has weight; only where rounding puts ``u`` of the total at the total
    itself does none exceed it, and the last token with weight is taken."""
    cdf = weights.cumsum(0)
    i = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))
    return i if i < len(cdf) else int(weights.nonzero().max())


def _draft_list(draft_tokens: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(draft_tokens, torch.Tensor):
        return [int(t) for t in draft_tokens.reshape(-1).tolist()]
    return [int(t) for t in draft_tokens]


def _checked(
    target_logits: torch.Tensor,
    k: int,
    draft_probs: torch.Tensor | None,
    allowed: torch.Tensor | None,
    drafts: list[int],
) -> torch.Tensor:
    """``target_logits`` as float32 on the CPU, once its shapes and the ids are checked."""
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1 or not target_logits.shape[1]:
        raise ValueError(
            f"target_logits {tuple(target_logits.shape)} are not [k + 1 = {k + 1}, V > 0]"
        )
    if not target_logits.is_floating_point():
        raise ValueError(f"target_logits must be floating point, got {target_logits.dtype}")
    v = target_logits.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (k, v):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} are not [k = {k}, V = {v}]")
    if allowed is not None and (allowed.dtype != torch.bool or tuple(allowed.shape) != (k + 1, v)):
        raise ValueError(f"allowed must be bool [k + 1 = {k + 1}, V = {v}]")
    if any(not 0 <= t < v for t in drafts):
        raise ValueError(f"draft tokens must be in [0, {v}), got {drafts}")
    return target_logits.detach().float().cpu()


def _bad_positions(logits: torch.Tensor, allowed: torch.Tensor | None) -> list[int]:
    """Positions without a distribution, by the sampler's rule: NaN or +inf anywhere, or no
    finite logit (among the allowed ones)."""
    if allowed is None:
        # One pass: a row's max is finite exactly when it holds no NaN (max propagates
        # it), no +inf, and some finite logit.
        return (~logits.amax(dim=1).isfinite()).nonzero().squeeze(1).tolist()
    bad = logits.isnan().any(dim=1) | logits.isposinf().any(dim=1)
    visible = torch.where(allowed.cpu(), logits, float("-inf"))
    bad |= ~visible.isfinite().any(dim=1)
    return bad.nonzero().squeeze(1).tolist()
