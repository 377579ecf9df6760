"""Cache-aware routing (platform/router.py) over a real pool and router: workers are
simulated at the HTTP boundary (their /load, and /tokenizer serving SmolLM2's real files),
and their heartbeats' prefix reports are applied as the internal API applies them.

A request goes to the replica holding its prompt's prefix unless that replica is at its
target concurrency; a conversation sticks to a replica before anything is cached; a
draining or dead replica's prefixes are forgotten; another deployment's (tenant's) never
steer a request."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_pool_scheduling import InstantBackend, _ready, _spec, run

from hotpool.platform.router import Affinity, Router
from hotpool.pool.pool import WorkerPool
from hotpool.pool.registry import WorkerRegistry
from hotpool.pool.replica import Replica, ReplicaState
from hotpool.worker.protocol import ChatMessage, GenerateRequest, LoadResult, SamplingParams
from hotpool.worker.tokenizer import TOKENIZER_FILES

DOC = " ".join(f"Clause {i}: the tenant pays {i * 3} dollars by day {i}." for i in range(40))


def _chat(question: str, doc: str = DOC) -> GenerateRequest:
    messages = (
        ChatMessage("system", f"Answer from this lease: {doc}"),
        ChatMessage("user", question),
    )
    return GenerateRequest("r", SamplingParams(max_tokens=4), messages=messages)


@pytest.fixture(scope="module")
def tokenizer_files(smollm2_snapshot_bf16: Path) -> dict[str, str]:
    snap = smollm2_snapshot_bf16
    return {n: (snap / n).read_text() for n in TOKENIZER_FILES if (snap / n).exists()}


async def _setup(
    files: dict[str, str], replicas: int, **spec_kw: Any
) -> tuple[Router, list[Replica]]:
    registry = WorkerRegistry()
    pool = WorkerPool(InstantBackend(registry), registry, "t", 4, 5.0)

    def worker_api(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/load":
            return httpx.Response(200, json=LoadResult("d", "sha", True, {}, "disk").to_json())
        if request.url.path == "/tokenizer":
            return httpx.Response(200, json={"digest": "sha", "files": files})
        return httpx.Response(200, json={"status": "unloaded"})

    pool.launcher.client = httpx.AsyncClient(transport=httpx.MockTransport(worker_api))
    spec = _spec("d", max_replicas=replicas, **spec_kw)
    reps = [await _ready(pool.scale_up(spec)) for _ in range(replicas)]
    for r in reps:  # the first heartbeat after the load: an empty cache, 16-token blocks
        r.prefixes.report([], [], True, 16)
    router = Router(pool, max_queue=8, queue_timeout_s=5)
    router.hasher._tokenizers.clear()
    return router, reps


async def _lease(router: Router, spec_kw: dict[str, Any], req: GenerateRequest,
                 user: str | None = None) -> Replica:  # fmt: skip
    async with router.lease(_spec("d", **spec_kw), affinity=Affinity(req, user)) as lease:
        return lease.replica


async def _tokenizer_ready(router: Router, reps: list[Replica]) -> None:
    router.hasher.hashes(reps[0], _chat("warm"))  # starts the fetch from a ready worker
    await router.hasher.wait_fetched("sha")
    assert router.hasher.ready("sha")


def test_requests_go_where_their_prefix_is_cached_unless_it_is_full(
    tokenizer_files: dict[str, str],
) -> None:
    async def scenario() -> None:
        kw = {"max_replicas": 3, "target_concurrency": 2}
        router, reps = await _setup(tokenizer_files, 3, target_concurrency=2)
        await _tokenizer_ready(router, reps)
        first = await _lease(router, kw, _chat("When is clause 3 due?"))
        # The same document, another question: the replica that prefilled it, even while it
        # is busier than the others (one request of its two).
        first.inflight = 1
        again = await _lease(router, kw, _chat("What does clause 9 cost?"))
        assert again is first
        assert router.decisions[("d", "prefix")] == 1
        # A queue in front of the prefix that costs more than computing it elsewhere.
        first.queued_tokens = 5000
        assert await _lease(router, kw, _chat("What does clause 10 cost?")) is not first
        first.queued_tokens = 0
        # At its target concurrency it is never picked for its cache.
        first.inflight = 2
        elsewhere = await _lease(router, kw, _chat("And clause 12?"))
        assert elsewhere is not first
        # Another document shares nothing: the least loaded replica.
        for r in reps:
            r.inflight = 0 if r is not first else 1
        before = router.decisions[("d", "least_loaded")]
        other = await _lease(router, kw, _chat("When is clause 3 due?", doc="Rent is due."))
        assert other is not first and router.decisions[("d", "least_loaded")] == before + 1
        # Each lease's prompt tokens were queued on its replica until it ended.
        assert all(r.queued_tokens == 0 for r in reps)
        async with router.lease(_spec("d", **kw), affinity=Affinity(_chat("Q?"))) as lease:
            work, r = lease.work, lease.replica
            assert work is not None and r.queued_tokens == work.prompt > 0
            assert r.queued_output_tokens == work.output == 4  # its max_tokens, under the mean
            work.prefilled()  # the first token
            work.produced(3)
            assert (r.queued_tokens, r.queued_output_tokens) == (0, 1)
        assert (r.queued_tokens, r.queued_output_tokens) == (0, 0)
        await router.pool.shutdown()

    run(scenario)


def test_reports_decide_and_forgotten_replicas_steer_nothing(
    tokenizer_files: dict[str, str],
) -> None:
    async def scenario() -> None:
        kw = {"max_replicas": 2}
        router, (a, b) = await _setup(tokenizer_files, 2)
        await _tokenizer_ready(router, [a, b])
        req = _chat("When is clause 3 due?")
        hashes = router.hasher.hashes(b, req)
        assert hashes
        # b's worker reports it cached the prompt (say, from a request routed elsewhere).
        b.prefixes.report(hashes, [], False, 16)
        a.inflight = 0
        assert await _lease(router, kw, req) is b
        # It reports them evicted: nothing steers there any more (a is least loaded).
        b.prefixes.report([], hashes, False, 16)
        a.prefixes.clear()
        b.inflight = 1
        assert await _lease(router, kw, req) is a
        b.inflight = 0
        # A draining replica's prefixes go with it.
        await asyncio.sleep(0)
        assert router.pool._begin_release(a, "test")
        assert a.state is ReplicaState.DRAINING and len(a.prefixes) == 0
        await router.pool.shutdown()

    run(scenario)


def test_a_conversation_sticks_before_anything_is_cached(tokenizer_files: dict[str, str]) -> None:
    async def scenario() -> None:
        kw = {"max_replicas": 3}
        router, _ = await _setup(tokenizer_files, 3)
        # No tokenizer here yet (so no hashes): the user decides, the same replica each time.
        picks = {u: {await _lease(router, kw, _chat(f"turn {t}"), u) for t in range(4)}
                 for u in ("alice", "bob", "carol", "dave", "erin", "frank")}  # fmt: skip
        assert all(len(p) == 1 for p in picks.values())
        assert len({next(iter(p)).id for p in picks.values()}) >= 2  # users spread out
        assert router.decisions[("d", "user")] == 24
        await router.pool.shutdown()

    run(scenario)


def test_another_deployments_prefixes_never_match(tokenizer_files: dict[str, str]) -> None:
    async def scenario() -> None:
        router, (a, b) = await _setup(tokenizer_files, 2)
        await _tokenizer_ready(router, [a, b])
        req = _chat("When is clause 3 due?")
        mine = router.hasher.hashes(a, req)
        # The same snapshot and prompt under another deployment's name (another tenant's):
        # the salt differs, so its worker's reports could never match these.
        b.load = LoadResult("other-tenant-deployment", "sha", True, {}, "disk")
        theirs = router.hasher.hashes(b, req)
        assert mine and theirs and not set(mine) & set(theirs)
        await router.pool.shutdown()

    run(scenario)
