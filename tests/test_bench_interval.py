"""bench_gateway.py's verdicts: the 95% interval of the added latency, by a paired bootstrap
over the batches, and the PASS?/FAIL? it gives a row the run cannot decide."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_gateway import Sample, added_interval, verdict_of
from serve_process import pct


def _samples(path: str, ms: list[float]) -> list[Sample]:
    return [Sample(path, ttft=v / 1e3, total=v / 1e3 * 4) for v in ms]


def test_a_constant_offset_has_an_interval_of_that_offset() -> None:
    rng = random.Random(1)
    direct = [rng.uniform(10, 30) for _ in range(32 * 40)]
    lo, hi = added_interval(
        _samples("direct", direct), _samples("gateway", [v + 1.5 for v in direct]), 32, "ttft", 0.5
    )
    assert math.isclose(lo, 1.5, abs_tol=1e-9) and math.isclose(hi, 1.5, abs_tol=1e-9)
    lo, hi = added_interval(
        _samples("direct", direct), _samples("gateway", [v + 1.5 for v in direct]), 32, "total", 0.5
    )
    assert math.isclose(lo, 6.0, abs_tol=1e-9) and math.isclose(hi, 6.0, abs_tol=1e-9)


def test_batches_that_move_together_widen_the_interval() -> None:
    """Each batch of 32 shares a random shift (one machine moment): the evidence is 40
    batches, not 1280 requests, and the interval must be wide enough to say so."""
    rng = random.Random(2)
    direct, gateway = [], []
    for _ in range(40):
        for path, out in (("direct", direct), ("gateway", gateway)):
            shift = rng.gauss(0, 4)
            out += [20 + shift + rng.gauss(0, 0.3) + (1.0 if path == "gateway" else 0.0)
                    for _ in range(32)]  # fmt: skip
    lo, hi = added_interval(_samples("d", direct), _samples("g", gateway), 32, "ttft", 0.5)
    point = pct(gateway, 0.5) - pct(direct, 0.5)
    assert lo <= point <= hi
    assert hi - lo > 2.0  # resampled request by request it would be ~0.1 ms wide
    assert lo < 1.0 < hi  # the true difference


def test_failed_requests_are_left_out_not_counted_as_zero() -> None:
    direct = _samples("direct", [10.0] * 64)
    gateway = _samples("gateway", [11.0] * 64)
    for s in gateway[::4]:
        s.error, s.ttft, s.total = "HTTP 502", None, math.nan
    lo, hi = added_interval(direct, gateway, 32, "ttft", 0.99)
    assert math.isclose(lo, 1.0) and math.isclose(hi, 1.0)


def test_too_few_batches_give_no_interval() -> None:
    lo, hi = added_interval(_samples("d", [1.0] * 32), _samples("g", [2.0] * 32), 32, "ttft", 0.5)
    assert math.isnan(lo) and math.isnan(hi)


def test_verdicts() -> None:
    assert verdict_of(1.0, (0.5, 1.5), 2.0) == "PASS"
    assert verdict_of(1.0, (-0.5, 3.0), 2.0) == "PASS?"
    assert verdict_of(3.0, (1.0, 4.0), 2.0) == "FAIL?"
    assert verdict_of(3.0, (2.5, 4.0), 2.0) == "FAIL"
    assert verdict_of(1.0, (math.nan, math.nan), 2.0) == "PASS"
