"""The engine's measured speed (worker/capacity.py) and how heartbeats carry it."""

from __future__ import annotations

import pytest

from hotpool.worker.capacity import MIN_STEPS, CapacityMeter
from hotpool.worker.protocol import WorkerInfo


def test_steps_make_a_curve_of_tokens_per_second_by_step_size() -> None:
    meter = CapacityMeter()
    for _ in range(MIN_STEPS - 1):
        meter.observe(0.05, 1)  # a lone stream's decode step: 20 tokens/s
    assert meter.curve == {}  # too few steps to tell
    meter.observe(0.05, 1)
    for _ in range(MIN_STEPS):
        meter.observe(0.5, 400)  # prefill steps of 400 tokens (bucket 257-512)
    assert meter.curve == {"1": 20.0, "400": 800.0}
    for _ in range(200):  # the machine got slower: the mean follows
        meter.observe(0.1, 1)
    assert meter.curve["1"] == pytest.approx(10.0, rel=0.01)
    for tokens in (300, 500) * 100:  # steps of several sizes in one bucket: their means
        meter.observe(tokens / 1000, tokens)
    (size,) = (k for k in meter.curve if 256 < int(k) <= 512)  # near their mean, 400
    assert 380 <= int(size) <= 420 and meter.curve[size] == pytest.approx(1000.0, rel=0.02)
    meter.observe(float("nan"), 3)
    meter.observe(0.1, 0)
    assert set(meter.curve) == {"1", size}


def test_a_prompt_step_is_reported_from_the_first_one() -> None:
    # A few short chats make one prefill step each, of sizes spread over buckets: waiting
    # for three of a bucket hid them, and the planner had only decode steps to go by.
    meter = CapacityMeter()
    for _ in range(MIN_STEPS):
        meter.observe(0.11, 1)
    meter.observe(0.2, 30)
    assert meter.curve == {"1": 9.1, "30": 150.0}
    meter.observe(0.06, 2)  # one decode step of two streams: too short to time alone
    assert set(meter.curve) == {"1", "30"}


@pytest.mark.parametrize(
    "capacity", [{"x": 1.0}, {"8": -1.0}, {"8": True}, ["8"], {str(i): 1.0 for i in range(40)}]
)
def test_a_malformed_capacity_is_refused(capacity: object) -> None:
    body = WorkerInfo("w", "http://x", 1, "cpu", 1).to_json()
    with pytest.raises(TypeError, match="capacity"):
        WorkerInfo.from_json({**body, "capacity": capacity})
    assert WorkerInfo.from_json({**body, "capacity": {"8": 100.0}}).capacity == {"8": 100.0}
