"""bf16 linear layers on the CPU: hotpool's kernel (``kernels/cpu_ops.c``, ``hp_linear``)
against oneDNN's prepacked linear (what torch's inductor emits for CPU) and plain
``F.linear``, in the same run.

Shapes are SmolLM2-135M's four per-layer linears (q/k/v fused, o, gate/up fused, down),
with a separate weight per layer for 30 layers, so the weights stream from memory as in a
real forward pass instead of sitting in the cache. Prints time per pass over the 30 layers,
GFLOP/s, and hotpool's speed-up over oneDNN, for row counts from a single decode to a
prefill chunk.

    python benchmarks/bench_linear.py
    python benchmarks/bench_linear.py --rows 32 --layers 30
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hotpool.kernels import cpu_ops

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) per layer


def timed(fn: Callable[[], None], seconds: float = 1.0) -> float:
    fn()
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or runs < 2:
        fn()
        runs += 1
    return elapsed / runs


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 2048])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops.load()
    if ops is None or not ops.avx512:
        print("hotpool's linear kernel needs the CPU kernels with AVX-512 BF16; not here")
        return 1
    g = torch.Generator().manual_seed(0)
    plain = [
        [torch.randn(n, k, generator=g).bfloat16() for k, n in SHAPES] for _ in range(args.layers)
    ]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws] for ws in plain]
    ours = [[ops.pack_linear(w) for w in ws] for ws in plain]
    flops_per_row = 2 * sum(k * n for k, n in SHAPES) * args.layers
    print(f"SmolLM2-135M linears x {args.layers} layers, bf16, {args.threads} threads; "
          "ms per pass (GFLOP/s)")  # fmt: skip
    print(f"{'rows':>5} | {'F.linear':>15} | {'oneDNN packed':>15} | {'hotpool':>15} | vs oneDNN")
    for m in args.rows:
        xs = [torch.randn(m, k, generator=g).bfloat16() for k, _ in SHAPES]

        def run(kind: str, xs: list[torch.Tensor] = xs) -> None:
            for layer in range(args.layers):
                for i, x in enumerate(xs):
                    if kind == "plain":
                        F.linear(x, plain[layer][i])
                    elif kind == "onednn":
                        torch.ops.mkldnn._linear_pointwise(
                            x, onednn[layer][i], None, "none", [], ""
                        )
                    else:
                        ops.linear(x, ours[layer][i], None)

        times = {kind: timed(lambda kind=kind: run(kind)) for kind in ("plain", "onednn", "ours")}
        cells = [
            f"{times[k] * 1e3:7.2f} ({m * flops_per_row / times[k] / 1e9:4.0f})"
            for k in ("plain", "onednn", "ours")
        ]
        ratio = times["onednn"] / times["ours"]
        print(f"{m:>5} | {cells[0]:>15} | {cells[1]:>15} | {cells[2]:>15} | {ratio:5.2f}x",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
