"""Token-aware scaling (pool/autoscaler.py, pool/capacity.py): a replica's backlog in
seconds of its own measured work scales a deployment as its request count does, so a few
very long prompts scale up as many short ones do; the KV cache filling up asks for one
more; a step load with a noisy backlog never flaps; each scale event says why."""

from __future__ import annotations

import asyncio
import random

from test_pool_scheduling import _pool, _ready, _settle, _spec, run

from hotpool.pool.autoscaler import Autoscaler
from hotpool.pool.capacity import backlog_seconds, mean_rates, rates
from hotpool.pool.replica import Replica, ReplicaState

# Tokens/s by step size as a CPU replica reports them: prefill steps are ~30x faster a
# token than a lone stream's decode steps.
CURVE = {"1": 16.0, "2": 30.0, "4": 56.0, "8": 100.0, "512": 900.0, "2048": 1000.0}


def test_rates_read_from_the_curve() -> None:
    r = rates(CURVE)
    assert r is not None and rates({}) is None
    assert r.prefill == 1000.0
    assert (r.at(1), r.at(3), r.at(8), r.at(4096)) == (16.0, 43.0, 100.0, 1000.0)  # between
    assert r.at(100) == 100.0 + 800.0 * 92 / 504
    # 4000 prompt tokens and 4 streams of 100 tokens: 4 s of prefill, 400 / 56 of decode.
    assert abs(backlog_seconds(4000, 400, 4, r) - (4.0 + 400 / 56)) < 1e-9
    half = rates({k: v / 2 for k, v in CURVE.items()})
    assert half is not None
    both = mean_rates([r, half])
    assert both is not None and both.prefill == 750.0 and both.at(8) == 75.0


async def _one_ready(
    window: float = 0.0, backlog_s: float = 4.0, **kw: object
) -> tuple[Autoscaler, Replica, list]:  # type: ignore[type-arg]
    pool, _, events = _pool(max_workers=6)
    spec = _spec("d", min_replicas=1, max_replicas=5, target_concurrency=8, idle_timeout_s=60)
    scaler = Autoscaler(pool, lambda: {"d": spec}, scale_down_window_s=window, backlog_s=backlog_s)
    await scaler.tick()
    (first,) = pool.replicas("d")
    await _ready(first)
    first.capacity = dict(CURVE)
    return scaler, first, events


def test_a_few_long_prompts_scale_up_as_many_short_requests_do() -> None:
    async def scenario() -> None:
        # 24 short chats: 24 / 8 per replica = 3 replicas, by their count.
        scaler, first, events = await _one_ready()
        first.inflight, first.queued_tokens, first.queued_output_tokens = 24, 24 * 40, 24 * 16
        await scaler.tick()
        assert len(scaler.pool.replicas("d")) == 3
        assert events[-1].reason == "load 24 > 1 x target_concurrency 8"
        await scaler.pool.shutdown()

        # Three 3000-token prompts: 3 requests (one replica by count), but 9000 tokens to
        # prefill at 1000 tokens/s and 3 x 16 to decode at 43: ~10.1 s of work, 4 s a replica.
        scaler, first, events = await _one_ready()
        first.inflight, first.queued_tokens, first.queued_output_tokens = 3, 9000, 48
        await scaler.tick()
        assert len(scaler.pool.replicas("d")) == 3
        assert events[-1].reason.startswith("backlog 10.1s of measured work > 1 x 4s")
        await scaler.pool.shutdown()

    run(scenario)


def test_requests_waiting_for_a_replica_count_at_the_mean_rates() -> None:
    async def scenario() -> None:
        pool, _, _ = _pool(max_workers=6)
        spec = _spec("d", min_replicas=1, max_replicas=5, target_concurrency=8, idle_timeout_s=60)
        waiting = {"work": (0, 0)}
        scaler = Autoscaler(
            pool, lambda: {"d": spec}, lambda n, v: 2, scale_down_window_s=0.0,
            waiting_work=lambda n, v: waiting["work"], backlog_s=4.0,
        )  # fmt: skip
        await scaler.tick()
        first = await _ready(pool.replicas("d")[0])
        first.capacity = dict(CURVE)
        waiting["work"] = (16_000, 256)  # two long prompts queued: 16 s + 256 / 100 s
        await scaler.tick()
        assert len(pool.replicas("d")) == 5  # ceil(18.6 / 4), within max_replicas
        await pool.shutdown()

    run(scenario)


def test_a_full_kv_cache_asks_for_one_more_replica() -> None:
    async def scenario() -> None:
        scaler, first, events = await _one_ready()
        first.inflight, first.kv_cache_usage = 2, 0.95
        await scaler.tick()
        assert len(scaler.pool.replicas("d")) == 2
        assert events[-1].reason == "KV cache 95% used on 1 replica(s)"
        await scaler.pool.shutdown()

    run(scenario)


def test_a_step_load_with_a_noisy_backlog_never_flaps() -> None:
    async def scenario() -> None:
        scaler, _, events = await _one_ready(window=0.5)
        rng = random.Random(0)
        counts = []
        for _ in range(40):  # the step: 9-13 s of work on the replicas, ticks 10 ms apart
            ready = [r for r in scaler.pool.replicas("d") if r.state is ReplicaState.READY]
            for r in ready:
                r.capacity = dict(CURVE)
                r.inflight = 2
                r.queued_tokens = int(rng.uniform(9000, 13000) / len(ready))
                r.queued_output_tokens = 0
            await scaler.tick()
            await _settle(scaler.pool)
            counts.append(len(scaler.pool.replicas("d")))
            await asyncio.sleep(0.01)
        assert counts == sorted(counts) and counts[-1] == 4  # up to ceil(13 / 4), never down
        ups = [e for e in events if e.to_replicas > e.from_replicas]
        assert all(e.reason.startswith(("min_replicas", "backlog")) for e in ups)
        for r in scaler.pool.replicas("d"):  # the load goes away
            r.inflight = r.queued_tokens = 0
        await asyncio.sleep(0.55)
        await scaler.tick()
        await _settle(scaler.pool)
        live = [r for r in scaler.pool.replicas("d") if r.state is not ReplicaState.DRAINING]
        assert len(live) == 1  # down once, after the window, to min_replicas
        await scaler.pool.shutdown()

    run(scenario)
