"""Admission in tokens (platform/router.py, Router._admit): at max_replicas, a request whose
replica holds more queued prompt tokens than it prefills in queue_timeout_s (at its measured
rate) is a 429 ``overloaded`` at once, with a Retry-After, its claim released; below
max_replicas, or before any rate is measured, or with a short enough backlog, it is served.
A few long prompts fill a replica this way as many short ones do."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_pool_scheduling import _pool, _ready, _spec, run
from test_token_scaling import CURVE

from hotpool.platform.errors import APIError
from hotpool.platform.router import Affinity, Router
from hotpool.pool.replica import Replica
from hotpool.worker.protocol import GenerateRequest, SamplingParams

PROMPT = GenerateRequest("r", SamplingParams(max_tokens=8), prompt="x" * 400)  # ~100 tokens


async def _router(max_replicas: int, replicas: int = 1) -> tuple[Router, list[Replica]]:
    pool, _, _ = _pool(max_workers=4)
    spec = _spec("d", max_replicas=max_replicas, target_concurrency=64)
    reps = [await _ready(pool.scale_up(spec)) for _ in range(replicas)]
    return Router(pool, max_queue=8, queue_timeout_s=5), reps


async def _served(router: Router, max_replicas: int) -> Replica:
    spec = _spec("d", max_replicas=max_replicas, target_concurrency=64)
    async with router.lease(spec, affinity=Affinity(PROMPT)) as lease:
        return lease.replica


def test_a_replica_holding_more_prompt_tokens_than_it_prefills_in_time_refuses() -> None:
    async def scenario() -> None:
        router, (rep,) = await _router(max_replicas=1)
        rep.capacity = dict(CURVE)  # 1000 prompt tokens/s at its best step size
        # Three 3000-token prompts queued: 9 s of prefill ahead, the timeout is 5 s.
        rep.inflight, rep.queued_tokens, rep.queued_output_tokens = 3, 9000, 48
        with pytest.raises(APIError) as refused:
            await _served(router, max_replicas=1)
        err = refused.value
        assert (err.status, err.code) == (429, "overloaded")
        assert err.retry_after_s == 4  # until 9 s of work is down to the 5 s allowed
        assert "~9s of prompts are queued" in err.message
        # Nothing of the refused request stays counted against the replica.
        assert (rep.inflight, rep.queued_tokens, rep.queued_output_tokens) == (3, 9000, 48)
        assert router.decisions[("d", "overloaded")] == 1

        # The same backlog as many short requests refuses too: tokens, not requests.
        rep.inflight, rep.queued_tokens = 60, 60 * 150
        with pytest.raises(APIError, match="at capacity"):
            await _served(router, max_replicas=1)

        # 4 s of prompts ahead fits in 5: served, and its own prompt joins the queue.
        rep.inflight, rep.queued_tokens = 3, 4000
        assert await _served(router, max_replicas=1) is rep
        assert (rep.inflight, rep.queued_tokens) == (3, 4000)  # released after the lease
        await router.pool.shutdown()

    run(scenario)


def test_below_max_replicas_or_unmeasured_a_long_backlog_is_served() -> None:
    async def scenario() -> None:
        # Room to scale: the request waits its turn while the autoscaler adds replicas.
        router, (rep,) = await _router(max_replicas=2)
        rep.capacity = dict(CURVE)
        rep.inflight, rep.queued_tokens = 3, 9000
        assert await _served(router, max_replicas=2) is rep
        # No step measured yet (a replica's first seconds): only request counts apply.
        rep.capacity = {}
        assert await _served(router, max_replicas=1) is rep
        await router.pool.shutdown()

        # Two replicas at max_replicas 2: the cache-aware router picks the emptier one,
        # which has room, so one overloaded replica refuses nobody.
        router, reps = await _router(max_replicas=2, replicas=2)
        for r in reps:
            r.capacity = dict(CURVE)
        reps[0].inflight, reps[0].queued_tokens = 3, 9000
        assert await _served(router, max_replicas=2) is reps[1]
        await router.pool.shutdown()

    run(scenario)


def _loaded(rep: Replica, context: int = 2048, token_bytes: int = 16) -> None:
    assert rep.load is not None
    rep.load = replace(rep.load, max_model_len=context, max_token_bytes=token_bytes)


def test_a_prompt_whose_bytes_prove_it_over_the_context_is_refused_before_admission() -> None:
    """Issue 46: an 8 MiB prompt was counted as ~2M queued tokens while its worker took
    seconds to tokenize it, and every other request of the deployment got 429s meanwhile;
    then it got its own 400. Now the bytes alone refuse it, counted against nothing."""

    async def scenario() -> None:
        router, (rep,) = await _router(max_replicas=1)
        _loaded(rep)  # 2048 tokens; no token stands for more than 16 bytes
        rep.capacity = dict(CURVE)
        huge = GenerateRequest("h", SamplingParams(max_tokens=8), prompt="x" * (8 << 20))
        spec = _spec("d", max_replicas=1, target_concurrency=64)
        with pytest.raises(APIError) as refused:
            async with router.lease(spec, affinity=Affinity(huge)):
                pass
        err = refused.value
        assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "prompt")
        assert "maximum context length is 2048 tokens" in err.message
        assert (rep.inflight, rep.queued_tokens) == (0, 0)
        # Within the bound (it may fit, only the tokenizer can tell): admitted, and counted
        # as one context at most, never as its ~4 characters a token.
        within = GenerateRequest("w", SamplingParams(max_tokens=8), prompt="y" * 60_000)
        async with router.lease(spec, affinity=Affinity(within)) as lease:
            assert lease.work is not None and lease.work.prompt == 2048
            assert rep.queued_tokens == 2048
            assert await _served(router, max_replicas=1) is rep  # others are not refused
        await router.pool.shutdown()

    run(scenario)
