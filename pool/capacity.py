"""A replica's measured speed (its worker's tokens/s by step size, worker/capacity.py) and
the backlog it holds, in seconds of its own work: what token-aware scaling weighs.

A replica's queued prompt tokens are computed in large steps, at the curve's best rate;
its expected output tokens come one per stream per step, at the rate of a step of as many
tokens as it runs streams. A backlog in seconds puts a few 8k-token prompts and many short
chats on one scale: each is the time the replica needs to get through what it was given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    """Tokens/s of one replica: ``prefill`` at its best step size; ``curve`` by step size."""

    prefill: float
    curve: tuple[tuple[int, float], ...]  # (tokens a step, tokens/s), ascending

    def at(self, tokens: float) -> float:
        """Tokens/s of a step of ``tokens`` tokens (``tokens`` streams decoding, or a prompt
        chunk): interpolated between the measured step sizes, the nearest one outside."""
        first, last = self.curve[0], self.curve[-1]
        if tokens <= first[0]:
            return first[1]
        for (s0, r0), (s1, r1) in zip(self.curve, self.curve[1:], strict=False):
            if tokens <= s1:
                return r0 + (r1 - r0) * (tokens - s0) / (s1 - s0)
        return last[1]


def rates(curve: Mapping[str, float] | None) -> Rates | None:
    """The rates of a reported curve; None before any step size was measured."""
    if not curve:
        return None
    points = tuple(sorted((int(k), float(v)) for k, v in curve.items()))
    return Rates(max(v for _, v in points), points)


def mean_rates(all_rates: Sequence[Rates]) -> Rates | None:
    """A deployment's typical replica: the mean of its replicas' rates, point by point
    (for work not on any replica yet: requests waiting for one)."""
    if not all_rates:
        return None
    sizes = sorted({s for r in all_rates for s, _ in r.curve})
    curve = tuple((s, sum(r.at(s) for r in all_rates) / len(all_rates)) for s in sizes)
    return Rates(sum(r.prefill for r in all_rates) / len(all_rates), curve)


def backlog_seconds(prompt_tokens: int, output_tokens: int, streams: int, r: Rates) -> float:
    """Seconds of work: ``prompt_tokens`` to prefill and ``output_tokens`` to decode over
    ``streams`` concurrent streams, at rates ``r``."""
    return prompt_tokens / r.prefill + output_tokens / r.at(max(streams, 1))
