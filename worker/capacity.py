"""What a replica can do, measured from its own engine steps: seconds per step by the
tokens in the step, as a curve of tokens/s. The control plane scales on it (a backlog of
prompt and output tokens, in seconds of this replica's work) and plans with it.

Steps are bucketed by their token count in powers of two (1, 2, 3-4, 5-8, .. up to the
step budget); each bucket keeps exponentially weighted means of its steps' tokens and
seconds, and reports the point (mean tokens, mean tokens / mean seconds): so the curve
follows a machine whose speed drifts (another tenant's job, thermal limits) within a few
dozen steps. Prefill steps fill the large buckets, decode steps of B streams the bucket of
B. A bucket of small steps is reported once it has seen a few of them; one of large steps
from its first: a prompt is one step a request, spread over buckets by its length, so a few
requests would otherwise show decode steps alone, and the planner would have no prefill to
go by. Updated from the engine thread, read by the heartbeat: a dict replaced whole, so a
reader sees one consistent curve.
"""

from __future__ import annotations

import math

ALPHA = 0.1  # weight of the newest step in its bucket's mean
MIN_STEPS = 3  # a bucket is reported once it has seen this many steps,
# or one step of more than this many tokens: long enough to time (a prompt's prefill).
ONE_STEP_TOKENS = 8


class CapacityMeter:
    def __init__(self) -> None:
        self._means: dict[int, tuple[float, float]] = {}  # bucket -> (tokens, seconds)
        self._steps: dict[int, int] = {}
        self.curve: dict[str, float] = {}  # step tokens (as text) -> tokens/s, for heartbeats

    def observe(self, seconds: float, tokens: int) -> None:
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        bucket = 1 << (tokens - 1).bit_length()  # the power of two at or above
        mean = self._means.get(bucket)
        if mean is None:
            self._means[bucket] = (float(tokens), seconds)
        else:
            t, s = mean
            self._means[bucket] = (t + ALPHA * (tokens - t), s + ALPHA * (seconds - s))
        self._steps[bucket] = self._steps.get(bucket, 0) + 1
        curve = {}
        for b, (t, s) in sorted(self._means.items()):
            if self._steps[b] >= MIN_STEPS or b > ONE_STEP_TOKENS:
                curve[str(max(1, round(t)))] = round(t / s, 1)
        self.curve = curve
