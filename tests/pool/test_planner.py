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
    eight = plan(Workload(1.0, 256, 16), CURVE, 2.0, devices_per_replica=8)
    assert (
        eight.devices == eight.gpus == 8 * (plan(Workload(1.0, 256, 16), CURVE, 2.0).replicas or 0)
    )
    assert small.prefill_measured and "estimated" not in small.why


def test_a_prompt_too_long_for_the_target_is_said_so() -> None:
    # 1024 tokens: within the largest measured step's bucket (512 tokens at 800 tokens/s).
    p = plan(Workload(1.0, 1024, 16), CURVE, ttft_p95=1.0)
    assert p.replicas is None and p.unreachable and "1024 tokens alone takes 1.28s" in p.why


def test_a_target_is_never_declared_unreachable_from_an_extrapolation() -> None:
    # 8000 tokens is 16 times the largest step measured: only an estimate, over 2 s.
    p = plan(Workload(1.0, 8000, 16), CURVE, ttft_p95=2.0)
    assert p.replicas is None and not p.unreachable
    assert "estimate" in p.why and "prompts of ~8000 tokens" in p.why


# What a lightly used CPU replica reports after a few short chats: a lone stream's decode
# steps (8.8 tokens/s), then also the prompts' prefill steps (~30 tokens each).
DECODE_ONLY = rates({"1": 8.8})
FIRST_CHATS = rates({"1": 8.8, "30": 150.0})
assert DECODE_ONLY is not None and FIRST_CHATS is not None


def test_a_replica_that_only_decoded_is_asked_for_prefill_not_declared_too_slow() -> None:
    # Decode steps say nothing of a 200-token prompt: charging each prompt token a decode
    # step made it "take 22.73 s" and the target unreachable.
    p = plan(Workload(0.5, 200, 16), DECODE_ONLY, ttft_p95=2.0)
    assert "alone takes" not in p.why
    assert p.replicas is None and p.prediction is None and not p.unreachable
    assert "prefill has not been measured yet" in p.why
    assert "prompts of ~200 tokens" in p.why
    assert DECODE_ONLY.step_time(200).seconds is None
    with pytest.raises(ValueError, match="prefill"):
        predict(Workload(0.5, 200, 16), DECODE_ONLY)


def test_prefill_is_estimated_from_the_prompts_seen() -> None:
    # A step costs a fixed part plus a part a token: 1/8.8 s for 1 token and 0.2 s for 30
    # make ~0.71 s for 200 (not 200 / 150 tokens/s = 1.33 s, the 30-token step's rate).
    p = plan(Workload(0.5, 200, 16), FIRST_CHATS, ttft_p95=1.0)
    assert p.replicas is not None and p.prediction is not None
    assert p.prediction.ttft_p95 <= 1.0 and not p.prefill_measured
    assert "prefill estimated from steps of up to 30 tokens" in p.why
    step = FIRST_CHATS.step_time(200)
    assert step.seconds == pytest.approx(0.2 + 170 * (0.2 - 1 / 8.8) / 29) and not step.measured
    assert FIRST_CHATS.step_time(60).measured  # within the largest measured step's bucket
    # A replica that has prefilled a prompt but not decoded yet: a lone stream's step is
    # no quicker than that prompt's, not as fast a token.
    prefilled = rates({"30": 150.0})
    assert prefilled is not None and prefilled.at(1) == pytest.approx(5.0)
    assert prefilled.at(0.5) == prefilled.at(1) and prefilled.at(60) == 150.0
    # Over the target by the estimate alone: not unreachable, but what would tell.
    tight = plan(Workload(0.5, 200, 16), FIRST_CHATS, ttft_p95=0.5)
    assert tight.replicas is None and not tight.unreachable and "~200 tokens" in tight.why
