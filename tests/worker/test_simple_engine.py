"""The engine as the worker drives it: token ids in, outputs out, finish reasons right."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiny_llama import tiny_model

from hotpool.worker.engine.async_engine import AsyncEngine
from hotpool.worker.engine.base import EngineRequest, RequestRejected
from hotpool.worker.engine.simple import SimpleEngine
from hotpool.worker.protocol import SamplingParams

EOS = frozenset({96})


def _engine(max_num_seqs: int = 8) -> SimpleEngine:
    return SimpleEngine(tiny_model(), torch.device("cpu"), max_num_seqs=max_num_seqs)


def _req(
    rid: str, prompt: tuple[int, ...], eos: frozenset[int] = frozenset(), **params: object
) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(**params), eos)  # type: ignore[arg-type]


def _run(engine: SimpleEngine, *reqs: EngineRequest) -> dict[str, tuple[list[int], str | None]]:
    for r in reqs:
        engine.add_request(r)
    out: dict[str, tuple[list[int], str | None]] = {r.request_id: ([], None) for r in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            ids, _ = out[o.request_id]
            out[o.request_id] = (ids + list(o.new_token_ids), o.finish_reason)
    return out


def test_greedy_output_does_not_depend_on_other_requests() -> None:
    a = _req("a", (1, 2, 3, 4), max_tokens=10, temperature=0.0)
    b = _req("b", (9, 8, 7), max_tokens=6, temperature=0.0)
    together = _run(_engine(), a, b)
    assert together["a"] == _run(_engine(), a)["a"]
    assert together["b"] == _run(_engine(), b)["b"]
    assert len(together["a"][0]) == 10 and together["a"][1] == "length"


def test_max_num_seqs_queues_the_rest_and_all_finish() -> None:
    reqs = [_req(str(i), (i + 1, 2), max_tokens=3, temperature=0.0) for i in range(5)]
    out = _run(_engine(max_num_seqs=2), *reqs)
    assert all(len(ids) == 3 and why == "length" for ids, why in out.values())


def test_eos_stops_unless_ignored() -> None:
    engine = _engine()
    first = _run(engine, _req("x", (5, 6), max_tokens=1, temperature=0.0))["x"][0][0]
    stop = _run(engine, _req("y", (5, 6), frozenset({first}), max_tokens=8, temperature=0.0))["y"]
    assert stop == ([first], "stop")
    ignored = _run(
        engine,
        _req("z", (5, 6), frozenset({first}), max_tokens=8, temperature=0.0, ignore_eos=True),
    )
    assert ignored["z"][1] == "length" and len(ignored["z"][0]) == 8


def test_seeded_sampling_repeats_and_seeds_differ() -> None:
    def sample(seed: int) -> list[int]:
        return _run(_engine(), _req("s", (1, 2, 3), max_tokens=12, temperature=1.0, seed=seed))[
            "s"
        ][0]

    assert sample(7) == sample(7)
    assert any(sample(7) != sample(s) for s in (8, 9, 10))


def test_rejects_what_can_never_fit_the_context() -> None:
    engine = _engine()  # tiny model: 256 positions
    with pytest.raises(RequestRejected, match="maximum context length is 256"):
        engine.add_request(_req("long", tuple(range(1, 90)) * 3, max_tokens=1))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request(_req("empty", (), max_tokens=1))
    # max_tokens=None means "up to the context": it finishes by length at 256 tokens.
    ids, why = _run(engine, _req("fill", (1, 2, 3), max_tokens=None, temperature=0.0))["fill"]
    assert why == "length" and len(ids) == 253


def test_abort_frees_the_request_at_any_moment() -> None:
    engine = _engine()
    engine.add_request(_req("gone", (1, 2), max_tokens=50))
    engine.step()
    engine.abort("gone")
    assert not engine.has_unfinished()
    engine.abort("never-existed")  # unknown ids are ignored


def test_async_engine_streams_and_aborts_when_the_consumer_leaves() -> None:
    async def main() -> None:
        engine = AsyncEngine(_engine())
        try:
            outs = [
                o
                async for o in engine.generate(_req("a", (1, 2, 3), max_tokens=5, temperature=0.0))
            ]
            assert [len(o.new_token_ids) for o in outs] == [1] * 5 and outs[
                -1
            ].finish_reason == "length"

            stream = engine.generate(_req("b", (1, 2, 3), max_tokens=200))
            await anext(stream)
            await stream.aclose()  # client gone
            for _ in range(100):
                if not engine.engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            assert not engine.engine.has_unfinished()

            with pytest.raises(RequestRejected):
                await anext(engine.generate(_req("c", (), max_tokens=1)))
        finally:
            engine.shutdown()

    asyncio.run(main())
