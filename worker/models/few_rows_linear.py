"""fp32 linear layers on the CPU at 1-4 rows: the weight as the left operand of a GEMM.

``F.linear(x, w)`` with a few rows of ``x`` reaches about half of this machine's memory
bandwidth: one row goes to MKL's GEMV, which here runs on one thread (15 GB/s on
SmolLM2's LM head, 2 threads), and 2-4 rows take a GEMM path that is slower still (2 rows
cost twice one). ``w @ x.T`` with at least two columns is a GEMM that MKL splits over the
weight's rows on every thread: 27-31 GB/s, the copy bandwidth (a single row is given a
second, discarded column to get there). Measured on SmolLM2-135M's shapes (576 -> 1536,
3072, 49152; 1536 -> 576) with 2 threads: 2.6-4.4x faster than ``F.linear`` at 2-4 rows,
about 2x at one; from 5 rows on it depends on the shape (0.8-2.4x), so ``F.linear`` keeps
those. That covers decode of a few streams and speculative verification at c = 1.

The class is swapped onto the model's ``nn.Linear`` modules in place (same parameters,
so tied embeddings stay tied) by :func:`use_few_rows_linears`, for fp32 models on the
CPU; any other input still takes ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = 4


class FewRowsLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0] if x.dim() == 2 else 0
        if not 1 <= m <= FEW_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        cols = torch.cat([x, x]) if m == 1 else x  # one row would take the GEMV again
        y = torch.mm(self.weight, cols.t()).t()[:m].contiguous()
        if self.bias is not None:
            y += self.bias
        return y


def use_few_rows_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`FewRowsLinear`; how many."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FewRowsLinear
            n += 1
    return n
