"""How much of the logits the Triton sampler reads, counted in Triton's CPU interpreter: the
GPU kernel's memory traffic, measured without a GPU.

The sampler is memory-bound on a GPU: its time is the logits it streams from memory. Here
every ``load_tile`` of the kernel, run by ``TRITON_INTERPRET=1`` exactly as a GPU would run
it (one row per program, the GPU's tile width and candidate slots), is counted per row, in
rows' worth of logits. The same rows go through the kernel twice in one run:

  candidates  the top_k / top_p searches read each row's candidates (the default);
  whole row   ``slots=0``: every bisection step reads the whole row (the kernel before the
              candidates, as measured on an H200 in docs/gpu_kernels.md).

Rows are shaped like a language model's (``lm_like``: a Zipf law with an exponent from 1.1
to 3, noise, random token order; as ``benchmarks/gpu_kernels.py``). The table gives the mean
and the largest per row: on a GPU the batch waits for its slowest rows. The scratch column
is what the searches read from the candidates' slots (cache-resident on a GPU).

    python benchmarks/sampler_traffic.py            # 16 rows of 128,256: ~3 minutes
    python benchmarks/sampler_traffic.py --batch 4 --vocab 32000
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np
import torch

from hotpool.kernels import sampling_candidates, sampling_pivot_search, triton_sampling

MIXES: list[tuple[str, dict[str, float]]] = [
    ("T=0.7 top_k=50", {"temperature": 0.7, "top_k": 50}),
    ("top_p=0.9", {"top_p": 0.9}),
    ("T=0.7 top_p=0.9", {"temperature": 0.7, "top_p": 0.9}),
    ("top_k=50 top_p=0.9", {"top_k": 50, "top_p": 0.9}),
    ("min_p=0.05", {"min_p": 0.05}),
]


def lm_like(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slope = torch.empty(batch, 1).uniform_(0.1, 1.1, generator=g).exp()
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    profile = -slope * ranks.log() + 0.3 * torch.randn(batch, vocab, generator=g)
    order = torch.rand(batch, vocab, generator=g).argsort(dim=1)
    return torch.empty_like(profile).scatter_(1, order, profile) + 10.0


class Counter:
    """Counts the logits each ``load_tile`` reads, per row of ``x``, and the rest (the
    candidates' slots) in total."""

    def __init__(self, x: torch.Tensor) -> None:
        self.start, self.row_bytes = x.data_ptr(), x.stride(0) * x.element_size()
        self.rows = np.zeros(x.shape[0])
        self.scratch = 0
        self.load_tile = sampling_pivot_search.load_tile
        for module in (triton_sampling, sampling_candidates, sampling_pivot_search):
            module.load_tile = self  # type: ignore[attr-defined]

    def __call__(self, base, idx, row_ok, limit):  # type: ignore[no-untyped-def]
        n = int(np.count_nonzero((row_ok[:, None] & (idx < limit)).handle.data))
        row = (int(np.asarray(base.handle.data).ravel()[0]) - self.start) // self.row_bytes
        if 0 <= row < len(self.rows):
            self.rows[row] += n
        else:
            self.scratch += n
        return self.load_tile(base, idx, row_ok, limit)

    def reset(self) -> None:
        self.rows[:] = 0
        self.scratch = 0


def params(b: int, mix: dict[str, float]) -> tuple[torch.Tensor, ...]:
    return (
        torch.full((b,), mix.get("temperature", 1.0)),
        torch.full((b,), int(mix.get("top_k", 0)), dtype=torch.int32),
        torch.full((b,), mix.get("top_p", 1.0)),
        torch.full((b,), mix.get("min_p", 0.0)),
        torch.full((b,), 7, dtype=torch.int64),
        torch.arange(b),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    x = lm_like(args.batch, args.vocab)
    counter = Counter(x)
    block, slots = triton_sampling.GPU_BLOCK, triton_sampling.GPU_SLOTS
    print(
        f"{args.batch} rows of {args.vocab} shaped like a language model's; the GPU's launch: "
        f"{block} lanes, {slots} slots, one row per program. Logits read per row, in rows:"
    )
    print(
        f"{'mix':<20} {'candidates mean':>15} {'max':>6} {'scratch':>8} "
        f"{'whole row mean':>14} {'max':>6} {'less read':>9}"
    )
    for name, mix in MIXES:
        reads = []
        tokens = []
        for use in (None, 0):
            counter.reset()
            got, _ = triton_sampling.triton_sample(
                x, *params(args.batch, mix), block=block, rows_per_program=1, slots=use
            )
            tokens.append(got.tolist())
            per = counter.rows / args.vocab
            reads.append((per.mean(), per.max(), counter.scratch / args.vocab / args.batch))
        if tokens[0] != tokens[1]:
            raise SystemExit(f"{name}: the two searches drew different tokens")
        (c_mean, c_max, c_scratch), (w_mean, w_max, _) = reads
        print(
            f"{name:<20} {c_mean:>15.2f} {c_max:>6.2f} {c_scratch:>8.3f} "
            f"{w_mean:>14.2f} {w_max:>6.2f} {w_mean / c_mean:>8.1f}x"
        )


if __name__ == "__main__":
    main()
