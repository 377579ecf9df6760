"""Turn a batch of logits into tokens.

Filters apply in this order, per row: temperature, then top-k, then top-p (nucleus over
the top-k survivors). ``temperature == 0`` is greedy (argmax). A seeded row draws from its
own ``torch.Generator``, so the same seed and prompt give the same tokens.

This is the CPU torch path; the fused Triton kernel (issue 4) will sit behind ``sample``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    generator: torch.Generator | None = None


def sample(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """Sample one token id per row of ``logits`` ``[B, V]``; returns int64 ``[B]``."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    out = torch.empty(len(rows), dtype=torch.long)
    for i, p in enumerate(rows):
        out[i] = _sample_row(logits[i].float(), p)
    return out


def _sample_row(logits: torch.Tensor, p: RowParams) -> int:
    if p.temperature == 0.0:
        return int(torch.argmax(logits))
    vocab = logits.shape[0]
    k = vocab if p.top_k <= 0 else min(p.top_k, vocab)
    # topk first, then work on the survivors: sorting the full vocabulary is the slow part.
    values, ids = torch.topk(logits / p.temperature, k)
    probs = torch.softmax(values, dim=-1)
    if p.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        keep = (cum - probs) < p.top_p  # the token that crosses top_p stays in
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    # One uniform draw and a search in the cumulative sum: the same distribution as
    # multinomial, much cheaper over a long row. Scale by the cumsum's own last value (not
    # ``probs.sum()``, which rounds differently) and take the first cdf >= u: then u never
    # lands past the last kept token, so a token top-p removed can never be drawn.
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=p.generator) * cdf[-1]
    idx = int(torch.searchsorted(cdf, u).clamp(max=k - 1))
    return int(ids[idx])
