"""The reference sampler: one row at a time, float64, sorting the whole vocabulary.

Slow and obviously correct, it spells out the order of ``hotpool.kernels.sampling``'s
docstring step by step and is what the tests hold the fast paths to; ``reference_probs``
gives the exact distribution a row's filters leave, for statistical tests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from hotpool.kernels.sampling_bitmask import allowed_tokens
from hotpool.kernels.sampling_random import row_generators, uniforms
from hotpool.kernels.sampling_types import NonFiniteLogitsError, SamplerOutput, SamplingRow


def penalize(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Step 1: ``row``'s penalties on one row of logits ``[V]``, in float64."""
    x = logits.double().clone()
    if row.repetition_penalty != 1.0:
        for t in set(row.prompt_token_ids) | set(row.output_token_ids):
            x[t] = x[t] / row.repetition_penalty if x[t] > 0 else x[t] * row.repetition_penalty
    for t, n in Counter(row.output_token_ids).items():
        x[t] -= row.frequency_penalty * n + row.presence_penalty
    return x


def reference_probs(
    logits: torch.Tensor, row: SamplingRow, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """Each token's exact probability ``[V]`` float64 after steps 1, 1b and 3-6, for one row
    of finite-or-(-inf) logits with at least one finite value among the ``allowed`` tokens
    (bool ``[V]``, the grammar's mask unpacked; None: all). Ties at a cut keep the lower
    token ids (a stable sort)."""
    x = penalize(logits, row)
    if allowed is not None:  # step 1b: a disallowed token is a -inf logit
        x[~allowed] = float("-inf")
    if row.greedy:  # step 3: the first of the largest
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).double()
    values, order = x.sort(descending=True, stable=True)
    w = torch.exp((values - values[0]) / row.temperature)  # step 3: the largest weighs 1
    w[w < row.min_p] = 0.0  # step 4: probability below min_p times the largest
    if 0 < row.top_k < len(w):
        w[row.top_k :] = 0.0  # step 5
    heavier = w.cumsum(0) - w  # step 6: the kept tokens before each one, renormalized
    w[heavier >= row.top_p * w.sum()] = 0.0
    probs = torch.zeros_like(w)
    probs[order] = w / w.sum()
    return probs


def reference_sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    token_bitmask: torch.Tensor | None = None,
) -> SamplerOutput:
    """``sample``'s contract, one row at a time: the same checks, the same randomness rules
    (one uniform per row), the same outputs, always exact. ``token_bitmask``: checked by
    ``sample``."""
    raw = logits.detach().float().cpu()
    raw_logprobs = torch.log_softmax(raw, dim=1)  # step 2
    bad = raw_logprobs[:, 0].isnan()
    allowed = None
    if token_bitmask is not None:
        allowed = allowed_tokens(token_bitmask.cpu(), raw.shape[1])
        # step 1b leaves no distribution where every allowed logit is -inf
        bad |= ~torch.where(allowed, raw, float("-inf")).isfinite().any(dim=1)
    if bad.any():
        raise NonFiniteLogitsError(bad.nonzero().squeeze(1).tolist())
    draws = iter(uniforms(row_generators([r for r in rows if not r.greedy])))
    tokens = []
    for i, (x, row) in enumerate(zip(raw, rows, strict=True)):
        probs = reference_probs(x, row, None if allowed is None else allowed[i])
        u = 0.0 if row.greedy else next(draws)
        cdf = probs.cumsum(0)
        # step 7: the first token whose cumulative probability exceeds u; never past the last
        # token with weight, however the cumulative sum rounds
        last = int(probs.nonzero().max())
        tokens.append(min(int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True)), last))
    token_ids = torch.tensor(tokens, dtype=torch.long)
    n = min(max((r.num_logprobs for r in rows), default=0), raw.shape[1])
    top = torch.topk(raw_logprobs, n, dim=1) if n else None
    return SamplerOutput(
        token_ids,
        raw_logprobs.gather(1, token_ids[:, None]).squeeze(1),
        (top.values, top.indices) if top is not None else None,
    )
