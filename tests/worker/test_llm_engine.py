"""The paged, continuously batching engine on a tiny random model: what users rely on."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import torch
from tiny_llama import TINY, tiny_model

from hotpool.worker.engine.async_engine import AsyncEngine
from hotpool.worker.engine.base import EngineRequest, RequestOutput, RequestRejected
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.attention import ContiguousAttention, PagedKVCache, SequenceKVCache
from hotpool.worker.protocol import SamplingParams

CPU = torch.device("cpu")
BLOCK_BYTES = PagedKVCache.bytes_per_block(2, 16, 2, 16, torch.float32)  # tiny model, fp32


def _engine(blocks: int = 256, **kw: object) -> LLMEngine:
    return LLMEngine(tiny_model(), CPU, EngineConfig(kv_cache_bytes=blocks * BLOCK_BYTES, **kw))  # type: ignore[arg-type]


def _req(rid: str, prompt: list[int] | tuple[int, ...], **params: object) -> EngineRequest:
    params.setdefault("temperature", 0.0)
    return EngineRequest(rid, tuple(prompt), SamplingParams(**params), frozenset())  # type: ignore[arg-type]


def _drain(
    engine: LLMEngine, arrivals: dict[int, list[EngineRequest]] | None = None
) -> dict[str, list[RequestOutput]]:
    """Run to completion; ``arrivals[step]`` requests join before that step (staggered)."""
    arrivals = dict(arrivals or {})
    outs: dict[str, list[RequestOutput]] = {}
    step = 0
    while arrivals or engine.has_unfinished():
        for r in arrivals.pop(step, []):
            engine.add_request(r)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        step += 1
        assert step < 10_000
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@torch.inference_mode()
def _reference(prompt: list[int], n: int, frequency_penalty: float = 0.0) -> list[int]:
    """Greedy tokens the obvious way: the whole sequence recomputed from scratch each time,
    each logit lowered by ``frequency_penalty`` times its token's count in the output so far
    (OpenAI's frequency penalty)."""
    model = tiny_model()
    c = model.config
    seq = list(prompt)
    for _ in range(n):
        cache = SequenceKVCache(
            c.num_hidden_layers, len(seq), c.num_key_value_heads, c.head_dim, torch.float32, CPU
        )
        hidden = model(
            torch.tensor(seq), torch.arange(len(seq)), ContiguousAttention(cache, 0, len(seq))
        )
        logits = model.logits(hidden[-1:])[0]
        for t in seq[len(prompt) :]:
            logits[t] -= frequency_penalty
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


PROMPTS = [
    [(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate([3, 17, 40, 5, 64, 33, 1, 90])
]


def test_staggered_mixed_batches_match_each_prompt_alone() -> None:
    # A small token budget forces chunked prefill to share steps with decodes.
    engine = _engine(max_num_batched_tokens=24)
    reqs = [_req(f"p{i}", p, max_tokens=12) for i, p in enumerate(PROMPTS)]
    outs = _drain(engine, {2 * i: [r] for i, r in enumerate(reqs)})
    for i, p in enumerate(PROMPTS):
        got = outs[f"p{i}"]
        assert _tokens(got) == _reference(p, 12), f"prompt {i}"
        assert got[-1].finish_reason == "length" and all(o.finish_reason is None for o in got[:-1])
        assert got[-1].num_prompt_tokens == len(p)


def test_bf16_fused_kernels_and_torch_ops_agree_up_to_near_ties() -> None:
    """The engine's bfloat16 CPU path (fused C kernels, paged attention included) against
    torch ops on the same batches. bfloat16 rounding differs between them, so (vLLM's
    ``check_logprobs_close`` rule) a request may diverge only where each side's token is in
    the other's top 5. The tiny random models have many near-ties, and which of them flip
    depends on summation order, so the share of identical requests is counted over three
    models (24 requests): a path that were wrong beyond rounding would lose most of them."""
    identical = total = 0
    for seed in (1, 2, 3):
        outs = {}
        for native in (True, False):
            model = tiny_model(seed=seed).to(torch.bfloat16)
            model.native_ops = native
            engine = LLMEngine(model, CPU, EngineConfig(kv_cache_bytes=512 * BLOCK_BYTES))
            assert engine.runner.attention.name == ("native" if native else "torch")
            reqs = [_req(f"p{i}", p, max_tokens=10, logprobs=5) for i, p in enumerate(PROMPTS)]
            outs[native] = _drain(engine, {i: [r] for i, r in enumerate(reqs)})
        for rid, ours in outs[True].items():
            theirs = outs[False][rid]
            pairs = [
                (a.new_token_ids[0], b.new_token_ids[0], a, b)
                for a, b in zip(ours, theirs, strict=True)
            ]
            total += 1
            first = next(((x, y, a, b) for x, y, a, b in pairs if x != y), None)
            if first is None:
                identical += 1
                continue
            x, y, a, b = first
            assert x in {t for t, _ in b.logprobs[0].top_logprobs}, (seed, rid)
            assert y in {t for t, _ in a.logprobs[0].top_logprobs}, (seed, rid)
    assert identical >= total // 2, f"{identical} of {total} requests identical"


def test_kv_pressure_preempts_and_every_output_is_unchanged() -> None:
    prompts = [[(3 * i + j) % 80 + 2 for j in range(20 + i)] for i in range(20)]
    free = _drain(_engine(), {0: [_req(f"r{i}", p, max_tokens=30) for i, p in enumerate(prompts)]})
    tight = _engine(blocks=12)  # ~3 sequences of ~50 tokens
    outs = _drain(tight, {0: [_req(f"r{i}", p, max_tokens=30) for i, p in enumerate(prompts)]})
    assert {k: _tokens(v) for k, v in outs.items()} == {k: _tokens(v) for k, v in free.items()}
    assert tight.stats().num_preemptions > 0
    assert tight.kv_manager.num_free_blocks == tight.kv_manager.num_blocks


def test_shared_prefix_is_served_from_cache_with_identical_output() -> None:
    prefix = [(5 * j) % 89 + 3 for j in range(512)]
    first, second = [*prefix, 1, 2, 3], [*prefix, 4, 5]
    long_context = replace(TINY, max_position_embeddings=1024)

    def run(caching: bool) -> tuple[list[int], int]:
        config = EngineConfig(kv_cache_bytes=256 * BLOCK_BYTES, enable_prefix_caching=caching)
        engine = LLMEngine(tiny_model(cfg=long_context), CPU, config)
        _drain(engine, {0: [_req("a", first, max_tokens=4)]})
        outs = _drain(engine, {0: [_req("b", second, max_tokens=8)]})["b"]
        return _tokens(outs), outs[-1].num_cached_tokens

    cached_tokens, n_cached = run(True)
    plain_tokens, n_plain = run(False)
    assert cached_tokens == plain_tokens
    assert n_cached == 512 and n_plain == 0  # all 32 full blocks of the shared prefix


def test_a_penalty_sees_every_token_generated_so_far_and_state_is_released() -> None:
    """The runner keeps each request's sampling row across steps: the penalty must still
    count the tokens of every step, in a staggered batch, and finished requests must leave
    nothing behind."""
    engine = _engine(max_num_batched_tokens=24)
    reqs = [_req(f"f{i}", p, max_tokens=14, frequency_penalty=1.5) for i, p in enumerate(PROMPTS)]
    outs = _drain(engine, {2 * i: [r] for i, r in enumerate(reqs)})
    for i, p in enumerate(PROMPTS):
        assert _tokens(outs[f"f{i}"]) == _reference(p, 14, frequency_penalty=1.5), f"prompt {i}"
    assert not engine.runner._rows  # every finished request's row and generator are gone


def test_abort_mid_generation_returns_every_block() -> None:
    engine = _engine()
    for i in range(6):
        engine.add_request(_req(f"a{i}", PROMPTS[i], max_tokens=50, temperature=1.0))
    for _ in range(5):
        engine.step()
    assert engine.kv_manager.num_free_blocks < engine.kv_manager.num_blocks
    for i in range(6):
        engine.abort(f"a{i}")
    engine.abort("unknown")
    assert not engine.has_unfinished()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert engine.kv_manager.usage == 0.0
    assert not engine.runner._rows  # nor any sampling state


def test_nan_logits_fail_that_request_alone_with_a_clear_error() -> None:
    clean = _drain(_engine(), {0: [_req("a", PROMPTS[0], max_tokens=8)]})
    engine = _engine()
    logits = engine.runner.model.logits
    step = {"n": 0}

    def faulty(hidden: torch.Tensor) -> torch.Tensor:
        out = logits(hidden)
        step["n"] += 1
        if step["n"] == 4:  # a numerical fault in one row, mid-generation
            out[1] = float("nan")
        return out

    engine.runner.model.logits = faulty  # type: ignore[method-assign]
    outs = _drain(engine, {0: [_req("a", PROMPTS[0], max_tokens=8), _req("b", PROMPTS[1])]})
    failed = [rid for rid, o in outs.items() if o[-1].finish_reason == "error"]
    assert len(failed) == 1
    last = outs[failed[0]][-1]
    assert last.new_token_ids == () and "NaN" in (last.error or "")
    (ok,) = set(outs) - set(failed)
    assert outs[ok][-1].finish_reason == "length"
    if ok == "a":
        assert _tokens(outs["a"]) == _tokens(clean["a"])  # the other row is untouched
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_same_seed_same_tokens_alone_and_in_a_crowd() -> None:
    target = _req(
        "seeded", [4, 8, 15, 16, 23, 42], max_tokens=16, temperature=1.0, top_p=0.9, seed=1234
    )
    alone = _tokens(_drain(_engine(), {0: [target]})["seeded"])
    rng = random.Random(0)
    crowd = [
        _req(
            f"o{i}",
            [rng.randrange(1, 95) for _ in range(rng.randrange(2, 30))],
            max_tokens=16,
            temperature=1.0,
        )
        for i in range(16)
    ]
    outs = _drain(_engine(), {0: crowd[:8], 1: [target], 2: crowd[8:]})
    assert _tokens(outs["seeded"]) == alone


def test_stop_token_ids_min_tokens_and_logprobs() -> None:
    first = _reference([9, 9, 9], 1)[0]
    outs = _drain(_engine(), {0: [_req("s", [9, 9, 9], max_tokens=10, stop_token_ids=(first,))]})[
        "s"
    ]
    assert _tokens(outs) == [first] and outs[-1].finish_reason == "stop"
    outs = _drain(
        _engine(), {0: [_req("m", [9, 9, 9], max_tokens=5, min_tokens=5, stop_token_ids=(first,))]}
    )["m"]
    assert len(_tokens(outs)) == 5 and outs[-1].finish_reason == "length"
    outs = _drain(_engine(), {0: [_req("l", [9, 9, 9], max_tokens=3, logprobs=4)]})["l"]
    for o in outs:
        (tok,) = o.logprobs
        assert tok.token_id == o.new_token_ids[0] and len(tok.top_logprobs) == 4
        assert tok.top_logprobs[0][0] == tok.token_id  # greedy: the best token was taken
        assert tok.logprob == pytest.approx(tok.top_logprobs[0][1])


def test_requests_that_can_never_fit_are_rejected_before_any_kv() -> None:
    engine = _engine(blocks=4)  # 64 tokens of KV
    with pytest.raises(RequestRejected, match="maximum context length is 256"):
        engine.add_request(_req("long", list(range(1, 250)), max_tokens=10))
    with pytest.raises(RequestRejected, match="KV cache"):
        engine.add_request(_req("big", list(range(1, 60)), max_tokens=10))
    with pytest.raises(RequestRejected, match="top_p"):
        engine.add_request(_req("bad", [1, 2], top_p=0.0))
    # Without max_tokens, min_tokens binds: past the context it would run to its end.
    with pytest.raises(RequestRejected, match=r"asks for at least 300 more \(min_tokens\)"):
        engine.add_request(_req("least", [1, 2], max_tokens=None, min_tokens=300))
    with pytest.raises(RequestRejected, match="asks for 1 more"):
        engine.add_request(_req("full", list(range(1, 257)), max_tokens=None))
    assert not engine.has_unfinished() and engine.kv_manager.num_free_blocks == 4


def test_async_engine_streams_and_aborts_when_the_consumer_leaves() -> None:
    async def main() -> None:
        engine = AsyncEngine(_engine())
        try:
            outs = [o async for o in engine.generate(_req("a", [1, 2, 3], max_tokens=5))]
            assert [len(o.new_token_ids) for o in outs] == [1] * 5 and outs[
                -1
            ].finish_reason == "length"

            stream = engine.generate(_req("b", [1, 2, 3], max_tokens=200, temperature=1.0))
            await anext(stream)
            await stream.aclose()  # the client went away
            for _ in range(200):
                if not engine.engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            assert not engine.engine.has_unfinished()

            with pytest.raises(RequestRejected):
                await anext(engine.generate(_req("c", [], max_tokens=1)))
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_async_engine_wakes_the_loop_once_per_step_for_all_its_streams() -> None:
    """Eight streams decoding together: each step's outputs reach the event loop in one
    hand-over (one self-pipe write and GIL hand-off), not one per stream."""

    async def main() -> tuple[int, int, list[int]]:
        loop = asyncio.get_running_loop()
        handovers = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kw):  # type: ignore[no-untyped-def]
            nonlocal handovers
            handovers += 1
            return original(callback, *args, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        engine = AsyncEngine(_engine())
        try:
            requests = [_req(f"r{i}", [1, 2, 3, i + 4], max_tokens=6) for i in range(8)]
            outs = [o async for o in engine.generate_many(requests)]
            return handovers, engine.engine.stats().num_steps, [len(o.new_token_ids) for o in outs]
        finally:
            engine.shutdown()

    handovers, steps, tokens = asyncio.run(main())
    assert tokens == [1] * 48  # every stream's six tokens arrived
    assert 0 < handovers <= steps  # one per step; one per output made it 48


def test_async_engine_outlives_an_event_loop_closed_under_its_stream() -> None:
    """A loop that ends with a stream still open (its outputs have nowhere to go) must not
    take the engine thread down with it: the next caller's request still runs."""
    engine = AsyncEngine(_engine())
    try:

        async def start() -> None:
            stream = engine.generate(_req("orphan", [1, 2, 3], max_tokens=60, temperature=1.0))
            await anext(stream)  # and never closed: the loop goes away under it

        loop = asyncio.new_event_loop()
        loop.run_until_complete(start())
        loop.close()
        time.sleep(0.1)  # the engine goes on with "orphan", handing outputs to a closed loop

        async def next_caller() -> list[RequestOutput]:
            stream = engine.generate(_req("next", [1, 2, 3], max_tokens=3))
            return await asyncio.wait_for(_collect(stream), 30)

        assert [len(o.new_token_ids) for o in asyncio.run(next_caller())] == [1, 1, 1]
    finally:
        engine.shutdown()


async def _collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in stream]


def test_stats_report_load() -> None:
    engine = _engine(max_num_seqs=2)
    for i in range(4):
        engine.add_request(_req(f"q{i}", PROMPTS[i], max_tokens=4))
    engine.step()
    s = engine.stats()
    assert (s.num_running, s.num_waiting) == (2, 2)
    assert 0 < s.kv_usage <= 1 and s.num_steps == 1 and s.last_step_tokens > 0


def test_a_failed_forward_pass_leaves_no_prefix_for_a_later_request() -> None:
    """A full block is registered in the prefix cache when it is allocated, before the pass
    that writes its KV: when that pass raises, the block holds whatever was there. The
    requests in the step fail, and a later request with the same prompt computes it anew
    instead of being served those blocks."""
    prompt = list(range(1, 41))  # two full blocks of 16, and 8 tokens more

    async def main() -> tuple[BaseException | None, list[RequestOutput]]:
        engine = AsyncEngine(_engine())
        runner = engine.engine.runner
        real = runner.execute

        def failing(step: object) -> object:
            runner.execute = real  # once  # type: ignore[method-assign]
            raise RuntimeError("the forward pass failed")

        runner.execute = failing  # type: ignore[method-assign]
        try:
            failed = None
            try:
                [o async for o in engine.generate(_req("first", prompt, max_tokens=2))]
            except RuntimeError as exc:
                failed = exc
            again = [o async for o in engine.generate(_req("again", prompt, max_tokens=2))]
            twice = [o async for o in engine.generate(_req("twice", prompt, max_tokens=2))]
            return failed, [again[-1], twice[-1]]
        finally:
            engine.shutdown()

    failed, (again, twice) = asyncio.run(main())
    assert isinstance(failed, RuntimeError)
    assert again.num_cached_tokens == 0  # nothing of the failed pass was served
    assert twice.num_cached_tokens == 32  # and the cache works again: "again" filled it
