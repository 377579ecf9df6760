"""The prefix-cache reports behind cache-aware routing: what the worker says it cached is
what the router computes for the same request (same ids, hashes and salt), evictions and
resets are reported, and the report stays bounded."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from hotpool.platform.prompt_hasher import INLINE_BYTES, PromptHasher, _tokenizer_from
from hotpool.pool.backend import WorkerHandle
from hotpool.pool.replica import Replica
from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.block_pool import BlockPool
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.engine.prefix_events import PrefixEvents, PrefixReport
from hotpool.worker.models.loader import load_model
from hotpool.worker.prefix_hash import deployment_salt, prompt_block_hashes, reported
from hotpool.worker.prompt import parse_tools, prompt_token_ids
from hotpool.worker.protocol import ChatMessage, GenerateRequest, LoadResult, SamplingParams
from hotpool.worker.tokenizer import TOKENIZER_FILES, TextTokenizer

CPU = torch.device("cpu")
SYSTEM = "You answer questions about the following report. " + " ".join(
    f"Section {i}: the committee reviewed item {i * 7} and approved it." for i in range(30)
)


def test_the_router_hashes_what_the_worker_caches(smollm2_snapshot_fp32: Path) -> None:
    snap = smollm2_snapshot_fp32
    tools = '[{"type": "function", "function": {"name": "lookup", "parameters": {}}}]'
    req = GenerateRequest(
        "r1",
        SamplingParams(max_tokens=1, temperature=0.0),
        messages=(ChatMessage("system", SYSTEM), ChatMessage("user", "What was item 70?")),
        tools=tools,
    )
    salt = deployment_salt("digest-1", "reports")
    engine = LLMEngine(load_model(snap, CPU, torch.float32), CPU,
                       EngineConfig(prefix_cache_salt=salt))  # fmt: skip
    assert engine.kv_manager.pool.events.take().reset  # a fresh engine: the whole (empty) state
    tok = TextTokenizer(snap)
    ids = prompt_token_ids(tok, req, parse_tools(req))
    engine.add_request(EngineRequest("r1", ids, req.params, frozenset()))
    while engine.has_unfinished():
        engine.step()
    report = engine.kv_manager.pool.events.take()
    assert not report.reset and not report.removed

    # The router's side: the tokenizer files as a worker serves them, the load it reported.
    files = {n: (snap / n).read_text() for n in TOKENIZER_FILES if (snap / n).exists()}
    hasher = PromptHasher(client=None)  # type: ignore[arg-type]  # no fetch: loaded below
    hasher._tokenizers["digest-1"] = _tokenizer_from(files)
    replica = Replica("rep-1", "reports", WorkerHandle("w1"))
    replica.load = LoadResult("reports", "digest-1", cache_hit=False)
    replica.prefixes.report(report.stored, report.removed, report.reset, block_size=16)
    hashes = hasher.hashes(replica, req)
    assert hashes is not None and len(hashes) == len(ids) // 16 >= 20
    assert hashes == [reported(h) for h in prompt_block_hashes(ids, 16, salt)]
    assert set(hashes) <= set(report.stored)
    assert replica.prefixes.matched(hashes) == len(hashes)
    # Another deployment of the same snapshot (another tenant's) hashes it differently.
    other = Replica("rep-2", "theirs", WorkerHandle("w2"))
    other.load = LoadResult("theirs", "digest-1", cache_hit=False)
    other.prefixes.block_size = 16
    theirs = hasher.hashes(other, req)
    assert theirs is not None and not set(theirs) & set(hashes)


def test_evictions_and_resets_are_reported() -> None:
    pool = BlockPool(4)
    assert pool.events.take().reset
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"a" * 16)
    pool.cache_full_block(b, b"b" * 16)
    pool.cache_full_block(pool.get_new_blocks(1)[0], b"c" * 16 + b"\x01")  # group 1: not told
    report = pool.events.take()
    assert report.stored == [reported(b"a" * 16), reported(b"b" * 16)] and not report.reset
    pool.free_blocks([a, b])
    pool.get_new_blocks(2)  # the free queue's head: evicts the blocks 'a' and... ('c' is held)
    report = pool.events.take()
    assert set(report.removed) <= {reported(b"a" * 16), reported(b"b" * 16)} and report.removed
    # Cached and evicted between two reports: nothing to say.
    (e,) = pool.get_new_blocks(1)
    pool.cache_full_block(e, b"e" * 16)
    pool.free_blocks([e])
    while pool.num_free_blocks:
        pool.get_new_blocks(1)
    assert pool.events.take() == PrefixReport([], [reported(b"b" * 16)])
    pool.events.lost()  # a heartbeat that did not arrive: the whole state next time
    again = pool.events.take()
    assert again.reset and set(again.stored) == {reported(k) for k in pool._cached if len(k) == 16}


def test_reports_stay_bounded() -> None:
    cached: list[bytes] = []
    events = PrefixEvents(lambda: cached, limit=8)
    events.take()
    for i in range(20):
        h = i.to_bytes(16, "little")
        cached.append(h)
        events.stored(h)
    report = events.take()  # past the limit: a reset with the newest 8
    assert report.reset and report.stored == [reported(h) for h in cached[-8:]]
    assert not events.take().reset


def test_a_long_prompt_is_hashed_from_ids_tokenized_off_the_event_loop(
    smollm2_snapshot_fp32: Path,
) -> None:
    """A prompt over INLINE_BYTES is never tokenized in key() (on the control plane's loop,
    a megabyte took ~0.4 s of every request's time): prepare() tokenizes it in a thread,
    the loop ticking meanwhile, and key() then finds the same ids inline tokenizing gives."""
    snap = smollm2_snapshot_fp32
    files = {n: (snap / n).read_text() for n in TOKENIZER_FILES if (snap / n).exists()}
    hasher = PromptHasher(client=None)  # type: ignore[arg-type]  # no fetch: loaded below
    hasher._tokenizers["digest-1"] = _tokenizer_from(files)
    replica = Replica("rep-1", "reports", WorkerHandle("w1"))
    replica.load = LoadResult("reports", "digest-1", cache_hit=False, kv_block_size=16)
    text = "the committee reviewed the item and approved it. " * 20_000  # ~1 MB
    req = GenerateRequest("long", SamplingParams(max_tokens=1), prompt=text)
    assert len(text) > INLINE_BYTES and hasher.key(replica, req) is None  # not inline

    async def prepare() -> float:
        task = asyncio.create_task(hasher.prepare([replica], req))
        longest = 0.0
        while not task.done():
            t0 = time.perf_counter()
            await asyncio.sleep(0.002)
            longest = max(longest, time.perf_counter() - t0)
        await task
        return longest

    t0 = time.perf_counter()
    longest = asyncio.run(prepare())
    took = time.perf_counter() - t0
    key = hasher.key(replica, req)
    ids = prompt_token_ids(TextTokenizer(snap), req, None)
    assert key is not None and key.tokens == len(ids) > 100_000
    assert key.hashes[:3] == [
        reported(h)
        for h in prompt_block_hashes(ids[:48], 16, deployment_salt("digest-1", "reports"))
    ]
    assert longest < took / 2, (longest, took)  # the loop ran while it tokenized
    hasher.forget("long")
    assert hasher.key(replica, req) is None and not hasher._prepared
