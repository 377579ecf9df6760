"""The capacity planner's queueing model (pool/planner.py) on a measured-looking curve."""

from __future__ import annotations

import math

import pytest

from hotpool.pool.capacity import rates
from hotpool.pool.planner import Workload, plan, predict

CURVE = rates({"1": 20.0, "2": 38.0, "4": 70.0, "8": 120.0, "256": 700.0, "512": 800.0})
assert CURVE is not None


def test_an_idle_replica_answers_in_its_prefill() -> None:
    p = predict(Workload(0.0, 256, 16), CURVE)
    assert p.ttft_p95 == pytest.approx(256 / 700) == p.ttft_mean
    assert p.utilization == 0.0
    assert CURVE.at(3) == pytest.approx(54.0) and CURVE.at(384) == pytest.approx(750.0)


def test_ttft_grows_with_the_rate_until_the_replica_cannot_keep_up() -> None:
    w = [predict(Workload(rate, 256, 16), CURVE) for rate in (0.1, 0.4, 0.8, 1.0, 1.2, 5.0)]
    stable = [p for p in w if p.stable]
    assert [p.ttft_p95 for p in stable] == sorted(p.ttft_p95 for p in stable)
    assert [p.utilization for p in w] == sorted(p.utilization for p in w)
    assert not w[-1].stable and math.isinf(w[-1].ttft_p95)
    # The mean wait is M/D/1's: below the p95, above the idle answer.
    mid = w[2]
    assert predict(Workload(0.0, 256, 16), CURVE).ttft_p95 < mid.ttft_mean < mid.ttft_p95
    # More streams decode at once as the rate grows (Little's law), at a batch's rate.
    long = [predict(Workload(rate, 64, 256), CURVE) for rate in (0.05, 0.2, 0.35)]
    assert long[0].decode_streams < long[1].decode_streams < long[2].decode_streams
    assert long[2].stable and long[2].decode_streams > 4


def test_a_plan_meets_the_target_with_the_headroom() -> None:
    small = plan(Workload(0.5, 256, 16), CURVE, ttft_p95=2.0)
    big = plan(Workload(10.0, 256, 16), CURVE, ttft_p95=2.0)
    assert small.replicas is not None and big.replicas is not None
    assert big.replicas >= 10 * small.replicas // 2  # roughly in proportion to the load
    for p in (small, big):
        assert p.prediction is not None and p.prediction.ttft_p95 <= 2.0
        assert p.prediction.utilization <= 0.7
    fewer = plan(Workload(10.0, 256, 16), CURVE, ttft_p95=2.0, headroom=0.1)
    assert fewer.replicas is not None and fewer.replicas <= big.replicas
    assert plan(Workload(1.0, 256, 16), CURVE, 2.0, gpus_per_replica=8).gpus == 8 * (
        plan(Workload(1.0, 256, 16), CURVE, 2.0).replicas or 0
    )


def test_a_prompt_too_long_for_the_target_is_said_so() -> None:
    p = plan(Workload(1.0, 8000, 16), CURVE, ttft_p95=2.0)
    assert p.replicas is None and "8000 tokens alone takes" in p.why
