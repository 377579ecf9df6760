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

# A step up to this many times the largest measured one counts as measured: the worker
# buckets steps by powers of two (worker/capacity.py) and reports each bucket's mean size,
# which may lie anywhere in its bucket. ``at()``'s nearest rate is then a close, cautious
# figure (a larger step is no slower a token).
MEASURED_REACH = 2
# How far beyond the largest measured step a prefill may be estimated: a step's cost a token
# grows with its size (small steps are bound by reading the weights, large ones by compute,
# and attention grows with the square), so a slope taken from small steps makes a large one
# look cheaper the further it reaches; past this it is no estimate at all.
ESTIMATE_REACH = 16


@dataclass(frozen=True)
class StepTime:
    """The seconds a step of some size takes, and what they rest on."""

    seconds: float | None  # None: no step measured near enough to tell
    measured: bool  # within the measured sizes; else an estimate beyond them
    largest: int  # the largest step size measured


@dataclass(frozen=True)
class Rates:
    """Tokens/s of one replica: ``prefill`` at its best step size; ``curve`` by step size."""

    prefill: float
    curve: tuple[tuple[int, float], ...]  # (tokens a step, tokens/s), ascending

    def at(self, tokens: float) -> float:
        """Tokens/s of a step of ``tokens`` tokens (``tokens`` streams decoding, or a prompt
        chunk): interpolated between the measured step sizes; outside them, what is sure of
        a step: no faster a token than the largest measured, no quicker than the smallest.
        (A replica that has prefilled a prompt but decoded little yet reports that step
        alone: its rate would make a lone stream decode as fast a token as a prompt.)"""
        first, last = self.curve[0], self.curve[-1]
        if tokens <= first[0]:
            return first[1] * max(tokens, 1) / first[0]  # the same seconds a step, from 1 up
        for (s0, r0), (s1, r1) in zip(self.curve, self.curve[1:], strict=False):
            if tokens <= s1:
                return r0 + (r1 - r0) * (tokens - s0) / (s1 - s0)
        return last[1]

    def step_time(self, tokens: int) -> StepTime:
        """Seconds of one step of ``tokens`` tokens: a prompt's prefill. From the curve up to
        ``MEASURED_REACH`` times its largest step; beyond, the step time extended along its
        slope, as a step costs a fixed part (the weights read once) plus a part a token.
        ``at()``'s nearest rate is no estimate that far: it charges every prompt token what
        one token of the largest step measured cost, which for a curve of decode steps alone
        is a whole decode step a token (a 200-token prompt "took" 22 s on a replica that
        prefills it in a fraction of one)."""
        largest = self.curve[-1][0]
        if tokens <= largest * MEASURED_REACH:
            return StepTime(tokens / self.at(tokens), True, largest)
        per_token = self._seconds_per_token()
        if per_token is None or tokens > largest * ESTIMATE_REACH:
            return StepTime(None, False, largest)
        return StepTime(
            largest / self.curve[-1][1] + per_token * (tokens - largest), False, largest
        )

    def _seconds_per_token(self) -> float | None:
        """What one more token adds to a step near the largest measured: the slope of step
        time from the largest step at most half as large (two steps of near sizes would
        make the slope their noise); None without one, or if the larger was not slower."""
        n1, r1 = self.curve[-1]
        below = [(n, r) for n, r in self.curve if n * 2 <= n1]
        if not below:
            return None
        n0, r0 = below[-1]
        slope = (n1 / r1 - n0 / r0) / (n1 - n0)
        return slope if slope > 0 else None


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
