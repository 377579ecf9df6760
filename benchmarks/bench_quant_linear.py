"""Weight-only quantized linears on the CPU (``kernels/quant_ops.c``) against torch's
``F.linear`` in float32 (the peer: what serving an fp32 checkpoint costs) and bfloat16, in
the same run.

Shapes are SmolLM2-135M's: k = 576 into n = 576 (o_proj), 1536 (one MLP half), 3072 (the
fused gate/up) and the LM head, n = 49152. Each kernel gets its own copies of the weight,
cycled so that the bytes come from memory as in a real forward pass, not from the cache
(``--copies``). Prints ms per call, the speed-up over fp32 ``F.linear`` and the effective
bandwidth of the weight bytes read (weight bytes / time).

Weights are placed as a deployment places them (``for_device``): Q8_0, Q4_0 and Q4_1
interleaved in 16-feature groups where this CPU's kernels read that layout (AVX2, AMX).

Q4_K's super-blocks take k in 256s and 576 is not one (llama.cpp's Q4_K_M files of this
model store those tensors in another type): its column runs k = 512 and is compared with
fp32 ``F.linear`` at k = 512, timed alongside.

    python benchmarks/bench_quant_linear.py
    python benchmarks/bench_quant_linear.py --rows 1 8 --seconds 0.2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from hotpool.kernels import quant_ops
from hotpool.kernels.quant_linear import for_device
from hotpool.kernels.quant_reference import random_gguf_bytes
from hotpool.kernels.quant_weight import (
    GgufKind,
    GgufWeight,
    Int8Weight,
    from_gguf_bytes,
    quantize_int8,
)

SHAPES = [(576, 576), (1536, 576), (3072, 576), (49152, 576)]  # (n, k)
KINDS = ("fp32", "bf16", "int8", "Q8_0", "Q4_0", "Q4_1", "fp32@512", "Q4_K")
Q4K_K = 512  # Q4_K's k (see above)


def timed(fn: Callable[[int], object], copies: int, seconds: float) -> float:
    """The median time of one call: robust to the other work on a shared machine."""
    fn(0)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        start = time.perf_counter()
        fn(len(times) % copies)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def weights(kind: str, w: torch.Tensor, gen: torch.Generator) -> tuple[object, int]:
    """One copy of ``w`` in ``kind`` and its size in bytes."""
    if kind == "Q4_K":
        w = w[:, :Q4K_K]
    n, k = w.shape
    if kind in ("fp32", "fp32@512"):
        w = w[:, :Q4K_K] if kind == "fp32@512" else w
        return w.clone(memory_format=torch.contiguous_format), 4 * w.numel()
    if kind == "bf16":
        return w.bfloat16(), 2 * w.numel()
    if kind == "int8":
        qw: object = Int8Weight(*quantize_int8(w))
    elif kind == "Q4_K":  # gguf has no Q4_K quantizer: random blocks, same bytes to read
        qw = GgufWeight(GgufKind.Q4_K, random_gguf_bytes(n, k, GgufKind.Q4_K, gen), (n, k))
    else:
        raw = quantize(w.numpy(), GGMLQuantizationType[kind])
        qw = from_gguf_bytes(kind, raw, (n, k))
    # As a deployment holds it: interleaved where this CPU's kernels read that faster.
    qw = for_device(qw, "cpu")  # type: ignore[arg-type]
    return qw, qw.nbytes  # type: ignore[attr-defined]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--seconds", type=float, default=0.3, help="timing per cell")
    ap.add_argument("--copies", type=int, default=0, help="weight copies (0: ~64 MB of fp32)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = quant_ops.load()
    if ops is None:
        print("the quantized C kernels did not build here")
        return 1
    gen = torch.Generator().manual_seed(0)
    print(f"quantized linear, {args.threads} threads, C path: {ops.simd}; "
          "ms per call (speed-up over fp32 F.linear) [GB/s of weight bytes]")  # fmt: skip
    for n, k in SHAPES:
        copies = args.copies or max(1, min(16, (64 << 20) // (4 * n * k)))
        base = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(copies)]
        made = {kind: [weights(kind, w, gen) for w in base] for kind in KINDS}
        print(f"\nn={n} k={k} ({copies} copies)")
        print(f"{'rows':>5} " + " ".join(f"{kind:>25}" for kind in KINDS if kind != "fp32@512"))
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            xb, x512 = x.bfloat16(), x[:, :Q4K_K].contiguous()
            cells, fp32 = [], 0.0
            for kind in KINDS:
                ws = made[kind]
                nbytes = ws[0][1]
                xk = {"bf16": xb, "fp32@512": x512, "Q4_K": x512}.get(kind, x)
                if kind in ("fp32", "bf16", "fp32@512"):
                    run = lambda i, ws=ws, xk=xk: F.linear(xk, ws[i][0])  # noqa: E731
                else:
                    run = lambda i, ws=ws, xk=xk: ops.linear(xk, ws[i][0], None)  # noqa: E731
                t = timed(run, copies, args.seconds)
                if kind.startswith("fp32"):
                    fp32 = t  # the peer of the columns after it
                if kind == "fp32@512":
                    continue
                cells.append(f"{t * 1e3:8.3f} ({fp32 / t:4.1f}x) [{nbytes / t / 1e9:5.1f}]")
            print(f"{m:>5} " + " ".join(f"{c:>25}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
