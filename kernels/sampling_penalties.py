"""Repetition, presence and frequency penalties, applied to a batch of logits before any path
samples it (the formulas are in ``hotpool.kernels.sampling``'s docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from hotpool.kernels.sampling_transfer import to_device
from hotpool.kernels.sampling_types import SamplingRow


def apply_penalties(raw: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """A penalized float32 copy of ``raw``, touching only the (row, token) pairs that occurred.

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
        pos, penalty = to_device(pos, x.device), to_device(penalty, x.device)
        values = flat[pos]
        flat[pos] = torch.where(values > 0, values / penalty, values * penalty)
    said = [i for i, r in enumerate(rows) if r.presence_penalty or r.frequency_penalty]
    pos, row = _flat_ids([(i, rows[i].output_token_ids) for i in said], v)
    if row.numel():
        presence = torch.tensor([r.presence_penalty for r in rows], dtype=torch.float32)[row]
        frequency = torch.tensor([r.frequency_penalty for r in rows], dtype=torch.float32)[row]
        pos = to_device(pos, x.device)
        flat[pos] = flat[pos] - to_device(presence, x.device)
        flat.index_add_(0, pos, to_device(-frequency, x.device))
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
