"""The float64 sliding-window attention reference the kernel tests compare against."""

from __future__ import annotations

import torch


def dense_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int | None
) -> torch.Tensor:
    """float64 attention of ``q [T, Hq, D]`` at positions ``start + i`` over one sequence's
    ``keys``/``values`` ``[S, Hkv, D]``, the mask built explicitly: p - window < k <= p."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * q.shape[2] ** -0.5
    key_pos = torch.arange(keys.shape[0])[None, :]
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    visible = (key_pos <= q_pos) & (key_pos > q_pos - (window or keys.shape[0]))
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)
