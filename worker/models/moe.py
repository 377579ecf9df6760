"""A sparse mixture-of-experts MLP (Qwen3-MoE): a router picks ``top_k`` experts per token,
and each expert runs once per step, on exactly the tokens routed to it.

Tokens are grouped by expert with one stable sort, so each expert is one pair of matmuls
over all its tokens (batched per expert), and experts no token chose cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hotpool.worker.models.config import MoEConfig


class SparseMoE(nn.Module):
    """``w13`` ``[E, 2 I, H]`` holds each expert's ``[gate | up]``, ``w2`` ``[E, H, I]`` its
    down projection; ``gate`` is the router."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (
            moe.num_experts, moe.top_k, moe.norm_topk_prob
        )  # fmt: skip
        inter = moe.intermediate_size
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, hidden_size, inter))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, each ``[T, top_k]``: HF's router (softmax in fp32 over all
        experts, the top k, renormalized when the config says so, weights in x's dtype)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(
        self, x: torch.Tensor, act_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``act_mul`` is the model's gated activation (``[T, 2 I] -> [T, I]``)."""
        weights, experts = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        # One host read per layer: which experts have tokens, and how many.
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            tokens = pairs // self.top_k
            h = act_mul(F.linear(x[tokens], self.w13[e]))
            y = F.linear(h, self.w2[e]) * weights.reshape(-1)[pairs, None]
            out.index_add_(0, tokens, y)
        return out
