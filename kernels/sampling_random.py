"""Where each row's random numbers come from, for every path (the rules are in
``hotpool.kernels.sampling``'s docstring): torch generators for the torch and reference
paths, Philox ``(seed, offset)`` pairs for the Triton kernel."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hotpool.kernels.sampling_types import SamplingRow

_MASK64 = 2**64 - 1


def row_generators(rows: Sequence[SamplingRow]) -> list[torch.Generator | None]:
    """Each row's generator: its own, else one seeded from ``(seed, offset)``, else None
    (torch's default generator)."""
    return [
        r.generator
        if r.generator is not None or r.seed is None
        else torch.Generator().manual_seed(_mix(r.seed, r.offset))
        for r in rows
    ]


def uniforms(generators: Sequence[torch.Generator | None]) -> list[float]:
    """One uniform in [0, 1) per row: from the row's own generator, else torch's default."""
    return uniform_draws(generators, [1] * len(generators))


def uniform_draws(
    generators: Sequence[torch.Generator | None], counts: Sequence[int]
) -> list[float]:
    """``counts[i]`` uniforms in [0, 1) for row i, one list row after row: from the row's own
    generator, else torch's default (one draw for all of those rows)."""
    shared = iter(
        torch.rand(sum(n for n, g in zip(counts, generators, strict=True) if g is None)).tolist()
    )
    out: list[float] = []
    for n, g in zip(counts, generators, strict=True):
        if n:
            out.extend(
                torch.rand(n, generator=g).tolist()
                if g is not None
                else [next(shared) for _ in range(n)]
            )
    return out


def philox_seeds(rows: Sequence[SamplingRow]) -> tuple[list[int], list[int]]:
    """Each row's ``(seed, offset)`` for the Triton kernel, as int64 values: the row's own
    seed; else one drawn from its generator; else one drawn from torch's default generator.
    """
    drawn = iter(_int64s(sum(r.seed is None and r.generator is None for r in rows), None))
    seeds = [
        _int64(r.seed)
        if r.seed is not None
        else _int64s(1, r.generator)[0]
        if r.generator is not None
        else next(drawn)
        for r in rows
    ]
    return seeds, [r.offset for r in rows]


def _int64s(n: int, generator: torch.Generator | None) -> list[int]:
    if not n:
        return []
    bound = 2**63 - 1
    return torch.randint(-bound, bound, (n,), dtype=torch.int64, generator=generator).tolist()


def _int64(seed: int) -> int:
    """A seed in [-2**63, 2**64) as the int64 with the same low 64 bits."""
    seed &= _MASK64
    return seed - 2**64 if seed >= 2**63 else seed


def _mix(seed: int, offset: int) -> int:
    """A 64-bit generator seed from ``(seed, offset)``: SplitMix64 of both, so neighbouring
    offsets of one seed, or seeds of one offset, start far apart."""
    return _splitmix64((seed & _MASK64) ^ _splitmix64(offset))


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
