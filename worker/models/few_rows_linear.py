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

Other machines and MKL builds disagree: on a 2-core AMX Xeon with torch 2.13, F.linear
reads 19-20 GB/s at one row and the GEMM 8-10 GB/s (2.1x slower). So the loader swaps only
where :func:`few_rows_pay` measures the GEMM faster on the model's own largest linears.

The class is swapped onto the model's ``nn.Linear`` modules in place (same parameters,
so tied embeddings stay tied) by :func:`use_few_rows_linears`, for fp32 models on the
CPU; any other input still takes ``F.linear``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = 4
# The GEMM must beat F.linear by this much to be swapped in: a tie is noise, and F.linear
# is what every other input takes anyway.
PAY_MARGIN = 0.9
PAY_BYTES = 128 << 20  # weights timed (the largest linears first): ~10 ms a pass


def few_rows_mm(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x [m, k] @ weight.T`` as ``weight @ x.T`` (m <= FEW_ROWS), ``[m, n]`` contiguous."""
    m = x.shape[0]
    cols = torch.cat([x, x]) if m == 1 else x  # one row would take the GEMV again
    return torch.mm(weight, cols.t()).t()[:m].contiguous()


class FewRowsLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0] if x.dim() == 2 else 0
        if not 1 <= m <= FEW_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        y = few_rows_mm(self.weight, x)
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


def _seconds(way: str, run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def few_rows_pay(
    model: nn.Module,
    repeats: int = 3,
    budget: int = PAY_BYTES,
    timer: Callable[[str, Callable[[], None]], float] = _seconds,
) -> bool:
    """Whether :class:`FewRowsLinear` is faster than ``F.linear`` on this machine: one row
    through the model's largest fp32 CPU linears (up to ``budget`` bytes of weights), each
    way ``repeats`` times alternately, best pass against best pass (``PAY_MARGIN``);
    ``timer(way, run)`` runs a pass and gives its seconds."""
    linears = [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32
        and m.weight.device.type == "cpu"
    ]  # fmt: skip
    linears.sort(key=lambda m: m.weight.numel(), reverse=True)
    timed: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = 0
    for m in linears:
        if timed and total + m.weight.nbytes > budget:
            break
        timed.append((m.weight, torch.ones(1, m.in_features)))
        total += m.weight.nbytes
    if not timed:
        return False

    def plain() -> None:
        for w, x in timed:
            F.linear(x, w)

    def few() -> None:
        for w, x in timed:
            few_rows_mm(w, x)

    ways = {"plain": plain, "few": few}
    best = dict.fromkeys(ways, float("inf"))
    with torch.inference_mode():
        for _ in range(repeats):
            for name, run in ways.items():
                best[name] = min(best[name], timer(name, run))
    return best["few"] < PAY_MARGIN * best["plain"]
