"""Capacity planning: how many replicas a workload needs for a TTFT target, from a
replica's measured speed (pool/capacity.py) and a queueing model.

The model of one replica, for requests of ``P`` prompt and ``O`` output tokens arriving at
random (Poisson) at ``rate`` per second; ``at(n)`` is the replica's measured tokens/s in a
step of ``n`` tokens (interpolated between the step sizes it measured):

- **Prefill** of a prompt is one step of ``S = P / at(P)`` seconds (the running streams'
  decode tokens ride in it, and prompts waiting together share one step: the engine's
  token budget takes them all), so prefill keeps the replica busy ``u_p = rate * S``.
  Beyond the step sizes measured, ``S`` is estimated along the step time's slope
  (``Rates.step_time``), or not at all: a plan says which, never claims a target
  unreachable from an estimate, and asks for prompts to measure when it cannot tell.
- **Decode** is a birth-death chain on the number ``B`` of streams decoding: with ``B``
  streams a step yields ``B`` tokens at ``at(B)`` tokens/s, so streams finish at
  ``at(B) / O`` a second, slowed to ``(1 - u_p)`` of that by the prefill steps they ride
  in. Its stationary distribution gives the streams decoding on average and the share of
  time the replica steps at all; it exists while ``rate * O`` stays under what the
  largest batches decode.
- **TTFT** = ``S`` + what is left of the step under way when the prompt arrives: a
  prefill step with probability ``u_p`` (uniform over ``S``), a decode step of the mean
  ``B`` streams (``B / at(B)`` seconds) with probability ``(1 - u_p) * busy``, none
  otherwise. The p95 and the mean follow from that mixture. Queues longer than one step
  are not modelled: with batched prefill they build only near saturation, which the
  headroom keeps plans away from.

A plan takes the fewest replicas whose predicted TTFT p95 meets the target with every
replica's utilisation at most ``1 - headroom`` (30% by default: queueing delay grows without
bound as utilisation nears 1, and traffic is burstier than Poisson). Requests spread evenly
over replicas (the router balances on load). How the model was checked against a measured
run: benchmarks/bench_autoscale.py ``--plan-check`` (docs/operations.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hotpool.pool.capacity import Rates, StepTime

P95 = 0.95
MAX_REPLICAS = 10_000
MAX_STREAMS = 4096  # the decode chain's states summed


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Prediction:
    """One replica at ``rate`` requests/s."""

    rate: float
    utilization: float  # of the replica, prefill and decode
    decode_streams: float  # streams decoding at once, on average
    ttft_p95: float  # seconds; inf when the replica cannot keep up
    ttft_mean: float

    @property
    def stable(self) -> bool:
        return math.isfinite(self.ttft_p95)


@dataclass(frozen=True)
class Plan:
    replicas: int | None  # None: no count meets the target, or the model cannot tell (why)
    devices: int | None  # replicas x devices each: GPUs, or CPU workers
    prediction: Prediction | None  # per replica, at the planned count
    headroom: float
    why: str
    prefill_measured: bool = True  # False: the prompt's prefill is estimated, or unknown

    @property
    def gpus(self) -> int | None:
        """``devices`` by its older name, from before CPU pools were planned."""
        return self.devices

    @property
    def unreachable(self) -> bool:
        """No replica count meets the target, by what was measured: an estimate never says
        so, as the next prompts measured may show it met."""
        return self.replicas is None and self.prefill_measured


def predict(w: Workload, r: Rates) -> Prediction:
    """TTFT of one replica serving ``w`` (see the module's model); ValueError when the
    prompt's prefill was not measured near enough to estimate (``Rates.step_time``)."""
    s = r.step_time(w.prompt_tokens).seconds
    if s is None:
        raise ValueError(f"prefill of {w.prompt_tokens}-token prompts has not been measured")
    u_prefill = w.rate * s
    unstable = Prediction(w.rate, math.inf, math.inf, math.inf, math.inf)
    if u_prefill >= 1:
        return unstable
    busy, streams = _decoding(w.rate * w.output_tokens, (1 - u_prefill), r)
    if busy is None:
        return unstable
    step = streams / r.at(streams) if streams > 0 else 0.0
    q = (1 - u_prefill) * busy  # arrivals that find a decode step under way
    utilization = u_prefill + q
    if utilization >= 1:
        return unstable

    def beyond(t: float) -> float:  # P(the residual step exceeds t)
        out = u_prefill * max(0.0, 1 - t / s)
        return out + (q * max(0.0, 1 - t / step) if step > 0 else 0.0)

    lo, hi = 0.0, max(s, step)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if beyond(mid) > 1 - P95 else (lo, mid)
    mean = s + u_prefill * s / 2 + q * step / 2
    return Prediction(w.rate, utilization, streams, s + hi, mean)


def _decoding(tokens_per_s: float, share: float, r: Rates) -> tuple[float | None, float]:
    """(share of time with a stream decoding, mean streams decoding) of the birth-death
    chain: from ``B`` streams, one more at ``rate``, one fewer at ``share * at(B) / O``;
    (None, inf) when it has no stationary distribution."""
    if tokens_per_s <= 0:
        return 0.0, 0.0
    if tokens_per_s >= share * r.at(MAX_STREAMS):
        return None, math.inf
    weights, w = [1.0], 1.0
    for b in range(1, MAX_STREAMS + 1):
        w *= tokens_per_s / (share * r.at(b))  # (rate * O) / (share * at(b))
        weights.append(w)
        if w < 1e-12 * sum(weights):
            break
    total = sum(weights)
    busy = 1 - weights[0] / total
    mean = sum(b * x for b, x in enumerate(weights)) / total
    return busy, mean


def plan(
    w: Workload,
    r: Rates,
    ttft_p95: float,
    headroom: float = 0.3,
    devices_per_replica: int = 1,
) -> Plan:
    """The fewest replicas for ``w`` meeting ``ttft_p95`` at utilisation <= 1 - headroom."""
    prefill = r.step_time(w.prompt_tokens)
    if prefill.seconds is None:
        why = (
            f"prefill has not been measured yet: the replicas measured steps of up to "
            f"{_tokens(prefill.largest)}, too few to tell a {w.prompt_tokens}-token prompt's; "
            + _how_to_measure(w.prompt_tokens)
        )
        return Plan(None, None, None, headroom, why, prefill_measured=False)
    alone = predict(Workload(0.0, w.prompt_tokens, w.output_tokens), r)
    if alone.ttft_p95 > ttft_p95:
        return _too_slow_alone(w, ttft_p95, headroom, alone, prefill)
    for n in range(1, MAX_REPLICAS + 1):
        p = predict(Workload(w.rate / n, w.prompt_tokens, w.output_tokens), r)
        if p.ttft_p95 <= ttft_p95 and p.utilization <= 1 - headroom:
            why = (
                f"{n} replica(s) at {p.utilization:.0%} utilisation each "
                f"(<= {1 - headroom:.0%}): TTFT p95 {p.ttft_p95:.2f}s <= {ttft_p95:g}s"
            )
            if not prefill.measured:
                why += f"; {_estimated(prefill)}: {_how_to_measure(w.prompt_tokens)}"
            return Plan(n, n * devices_per_replica, p, headroom, why, prefill.measured)
    why = f"more than {MAX_REPLICAS} replicas"
    return Plan(None, None, None, headroom, why, prefill.measured)


def _too_slow_alone(
    w: Workload, ttft_p95: float, headroom: float, alone: Prediction, prefill: StepTime
) -> Plan:
    """The plan when one prompt on an idle replica already misses the target: unreachable
    if its prefill was measured; if estimated, what would tell."""
    if prefill.measured:
        why = (
            f"one prompt of {w.prompt_tokens} tokens alone takes {alone.ttft_p95:.2f}s to its "
            f"first token on a replica, over the {ttft_p95:g}s target"
        )
        return Plan(None, None, alone, headroom, why)
    why = (
        f"one prompt of {w.prompt_tokens} tokens alone would take ~{alone.ttft_p95:.2f}s to "
        f"its first token on a replica, over the {ttft_p95:g}s target, but that is an "
        f"estimate ({_estimated(prefill)}): {_how_to_measure(w.prompt_tokens)}"
    )
    return Plan(None, None, alone, headroom, why, prefill_measured=False)


def _estimated(prefill: StepTime) -> str:
    return f"prefill estimated from steps of up to {_tokens(prefill.largest)}"


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _how_to_measure(prompt_tokens: int) -> str:
    # A replica measures its prefill from the prompts it serves (worker/capacity.py).
    return (
        f"send the deployment a few requests with prompts of ~{prompt_tokens} tokens, "
        "then plan again"
    )
