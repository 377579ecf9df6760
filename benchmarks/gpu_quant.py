"""GPU timing of the Triton weight-only linears (``kernels/triton_quant_linear.py``) against
cuBLAS bf16 ``F.linear``, at a Llama-3-8B's layer shapes and decode-to-prefill row counts.

    python benchmarks/gpu_quant.py [--quick]      # also: bash benchmarks/run_gpu_checks.sh

For each shape (``k -> n``) and row count ``m``, the median time (``triton.testing.do_bench``:
CUDA events, warm-ups, L2 flushed) of
- ``bf16``: ``F.linear(x, w)`` with a bf16 weight (what an unquantized deployment runs);
- ``int8``: per-output-channel symmetric int8 (``quantization: int8``'s CUDA path);
- ``int4``: groups of 128, symmetric (AWQ/GPTQ-style); ``q4_1``: groups of 32 with a minimum
  (GGUF Q4_1 repacked).
Each column prints ms and the weight bytes read per second against the device's measured
copy bandwidth (reads + writes of a 2 GiB copy): a decode row is bound by reading the
weight once, so ``int8`` can approach 2x and ``int4`` ~3.5x bf16 there, and at 256 rows
the kernels should stay within reach of cuBLAS. Before the table each kernel's output is
checked against the torch reference on the GPU. Then a tile sweep at one shape prints
each ``(BLOCK_M, BLOCK_N)``'s time, the measurement that ``_tiles`` should follow.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gpu_kernels import fail, import_hotpool, median_ms

# Llama-3-8B: qkv (4096 -> 6144), o_proj, gate+up fused (4096 -> 28672), down (14336 -> 4096).
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
ROWS = [1, 8, 32, 128, 256]
TILES = [(16, 32), (16, 64), (16, 128), (32, 64), (64, 64), (64, 128), (128, 128)]


def copy_gbps() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def weights(k: int, n: int) -> dict[str, object]:
    from hotpool.kernels.quant_weight import Int8Weight, quantize_int4, quantize_int8

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    q, scale = quantize_int8(w)
    return {
        "bf16": w.bfloat16(),
        "int8": Int8Weight(q, scale),
        "int4": quantize_int4(w, group_size=128, symmetric=True),
        "q4_1": quantize_int4(w, group_size=32, symmetric=False),
    }


def nbytes(w: object) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes  # type: ignore[attr-defined]


def call(
    x: torch.Tensor, w: object, tiles: tuple[int, int] | None = None
) -> Callable[[], torch.Tensor]:
    from hotpool.kernels.triton_quant_linear import triton_quant_linear

    if isinstance(w, torch.Tensor):
        return lambda: F.linear(x, w)
    return lambda: triton_quant_linear(x, w, tiles=tiles)  # type: ignore[arg-type]


def check(shape: tuple[int, int]) -> bool:
    """Each kernel against the torch reference (float32 over the dequantized weight)."""
    from hotpool.kernels.quant_torch import torch_quant_linear

    k, n = shape
    ok = True
    for name, w in weights(k, n).items():
        if isinstance(w, torch.Tensor):
            continue
        for m in (1, 17, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            got = call(x, w)().float()
            want = torch_quant_linear(x, w).float()  # type: ignore[arg-type]
            err = ((got - want).abs().max() / want.abs().max()).item()
            if err > 1e-2:
                print(f"  MISMATCH {name} {k}->{n} m={m}: max rel err {err:.2e}")
                ok = False
    print(f"check {k}->{n}: {'all kernels match the torch reference' if ok else 'FAILED'}")
    return ok


def table(shapes: list[tuple[int, int]], rows: list[int], copy: float) -> None:
    names = ["bf16", "int8", "int4", "q4_1"]
    head = f"{'k -> n':>13} {'m':>4} | " + " | ".join(f"{n:>5} ms  GB/s" for n in names)
    print(f"\n{head} | int8/bf16 int4/bf16 q4_1/bf16")
    print("-" * len(head) + "-" * 32)
    for k, n in shapes:
        ws = weights(k, n)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = {name: median_ms(call(x, w)) for name, w in ws.items()}
            cells = " | ".join(f"{ms[w]:8.4f} {nbytes(ws[w]) / ms[w] / 1e6:5.0f}" for w in names)
            ratios = " ".join(f"{ms['bf16'] / ms[w]:9.2f}" for w in names[1:])
            print(f"{k:>6}->{n:<6} {m:>4} | {cells} | {ratios}")
    print(f"(GB/s: weight bytes read per second; the device's copy moves {copy:.0f} GB/s)")


def sweep(k: int, n: int, rows: list[int]) -> None:
    print(f"\ntile sweep at {k}->{n}: ms for each (BLOCK_M, BLOCK_N); * = the wrapper's choice")
    from hotpool.kernels.triton_quant_linear import _tiles

    ws = weights(k, n)
    for name in ("int8", "int4", "q4_1"):
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            chosen = _tiles(m, n)
            cells = []
            for tiles in TILES:
                if tiles[0] > max(16, 2 * m) and tiles[0] > 16:
                    continue  # far taller than the rows: wasted work
                try:
                    t = median_ms(call(x, ws[name], tiles))
                except Exception as e:  # a tile the compiler refuses (shared memory)
                    cells.append(f"{tiles}: {type(e).__name__}")
                    continue
                cells.append(f"{tiles}{'*' if tiles == chosen else ''}: {t:.4f}")
            print(f"  {name:5} m={m:<4} " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, three row counts")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        fail("no CUDA device is visible to torch; these checks need a GPU")
    os.environ.pop("TRITON_INTERPRET", None)
    import_hotpool()
    from hotpool.kernels.triton_quant_linear import interpreted

    if interpreted():
        fail("the quant kernels were decorated for the interpreter; run in a fresh process")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    copy = copy_gbps()
    print(f"copy bandwidth {copy:.0f} GB/s (reads + writes)")
    shapes = SHAPES[1:3] if args.quick else SHAPES
    ok = all(check(s) for s in shapes[:2])
    table(shapes, [1, 32, 256] if args.quick else ROWS, copy)
    if not args.no_sweep:
        sweep(4096, 28672, [1, 32, 256])
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    sys.exit(main())
