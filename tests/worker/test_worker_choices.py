"""n choices and logprobs as the worker streams them: a tiny random model behind SmolLM2's
real tokenizer, driven through :class:`WorkerService` (no HTTP)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch
from loaded_service import tiny_service

from hotpool.worker.choices import Choices
from hotpool.worker.engine.base import EngineRequest, RequestOutput, RequestRejected
from hotpool.worker.protocol import (
    ChatMessage,
    GenerateEvent,
    GenerateRequest,
    PositionLogprobs,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from hotpool.worker.service import WorkerService
from hotpool.worker.tokenizer import TextTokenizer

CPU = torch.device("cpu")
SHORT = "Tell me a story"  # under one KV block: no prefix-cache hits, bit-for-bit repeatable
LONG = "The quick brown fox jumps over the lazy dog. " * 4  # several full blocks


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[WorkerService]:
    with tiny_service(smollm2_snapshot_bf16, tmp_path_factory.mktemp("cache")) as svc:
        yield svc


def _run(
    service: WorkerService, rid: str, prompt: str = SHORT, **params: object
) -> list[GenerateEvent]:
    req = GenerateRequest(rid, SamplingParams(**params), prompt=prompt)  # type: ignore[arg-type]

    async def collect() -> list[GenerateEvent]:
        return [e async for e in service.generate(req)]

    return asyncio.run(collect())


def _by_choice(events: list[GenerateEvent]) -> dict[int, list[GenerateEvent]]:
    out: dict[int, list[GenerateEvent]] = {}
    for e in events:
        out.setdefault(e.index, []).append(e)
    return out


def test_n_choices_stream_tagged_and_bill_the_prompt_once(service: WorkerService) -> None:
    events = _run(service, "n3", n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    choices = _by_choice(events)
    assert sorted(choices) == [0, 1, 2]
    for evs in choices.values():
        assert [e.finish_reason for e in evs][-1] == "length"
        assert [e.finish_reason for e in evs[:-1]] == [None] * (len(evs) - 1)
        assert sum(len(e.token_ids) for e in evs) == 6
    n_prompt = len(service.loaded.tokenizer.encode(SHORT))  # type: ignore[union-attr]
    assert events[-1].usage == Usage(n_prompt, 18, 0)  # the prompt once, 3 x 6 completion
    assert events[-1].finish_reason == "length"  # the stream ends with the last choice's end
    tokens = {i: [t for e in evs for t in e.token_ids] for i, evs in choices.items()}
    assert len({tuple(t) for t in tokens.values()}) > 1  # seed + i: the choices differ

    again = _by_choice(_run(service, "n3-again", n=3, max_tokens=6, temperature=1.0, seed=7,
                            ignore_eos=True))  # fmt: skip
    assert {i: [t for e in evs for t in e.token_ids] for i, evs in again.items()} == tokens


def test_choices_share_the_prompt_blocks_and_its_cache_hit_is_billed_once(
    service: WorkerService,
) -> None:
    engine = service.loaded.engine.engine  # type: ignore[union-attr]
    n_prompt = len(service.loaded.tokenizer.encode(LONG))  # type: ignore[union-attr]
    full_blocks = (n_prompt - 1) // 16 * 16
    hits_before = engine.stats().prefix_cache_hits
    events = _run(service, "shared", prompt=LONG + "x", n=4, max_tokens=2, temperature=0.0)
    assert engine.stats().prefix_cache_hits - hits_before == 3 * full_blocks  # 3 of 4 reuse
    usage = events[-1].usage
    assert usage is not None and usage.cached_tokens == 0  # the prompt itself was new
    assert usage.completion_tokens == sum(len(e.token_ids) for e in events)


def test_abort_stops_every_choice(service: WorkerService) -> None:
    req = GenerateRequest("ab", SamplingParams(n=3, max_tokens=200, ignore_eos=True), prompt=SHORT)

    async def scenario() -> list[GenerateEvent]:
        stream = service.generate(req)
        events = [await anext(stream)]
        assert service.abort("ab")
        events += [e async for e in stream]
        return events

    events = asyncio.run(scenario())
    finishes = {e.index: e.finish_reason for e in events if e.finish_reason}
    assert finishes == {0: "abort", 1: "abort", 2: "abort"}
    assert events[-1].usage is not None and events[-1].usage.completion_tokens < 600
    assert not service.abort("ab")  # nothing left to stop
    engine = service.loaded.engine.engine  # type: ignore[union-attr]
    for _ in range(100):
        if not engine.has_unfinished():
            break
        asyncio.run(asyncio.sleep(0.01))
    assert not engine.has_unfinished()


def test_logprobs_come_with_each_token(service: WorkerService) -> None:
    events = _run(service, "lp", n=2, max_tokens=5, temperature=0.0, logprobs=4, ignore_eos=True)
    tok = service.loaded.tokenizer  # type: ignore[union-attr]
    for evs in _by_choice(events).values():
        positions = [p for e in evs for p in e.logprobs]
        assert [p.sampled.token_id for p in positions] == [t for e in evs for t in e.token_ids]
        for p in positions:
            assert len(p.top) == 4
            values = [t.logprob for t in p.top]
            assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
            assert p.top[0].token_id == p.sampled.token_id  # greedy takes the best
            assert p.top[0].logprob == pytest.approx(p.sampled.logprob, abs=1e-6)
            for t in (p.sampled, *p.top):
                assert (t.token, t.utf8) == tok.token_piece(t.token_id)


def test_without_logprobs_events_carry_none(service: WorkerService) -> None:
    events = _run(service, "nolp", max_tokens=3, temperature=0.0)
    assert all(e.logprobs == () for e in events)
    events = _run(service, "lp0", max_tokens=3, temperature=0.0, logprobs=0)
    assert all(len(e.logprobs) == len(e.token_ids) for e in events)
    assert all(p.top == () for e in events for p in e.logprobs)


def test_too_many_choices_are_rejected_before_any_token(service: WorkerService) -> None:
    with pytest.raises(RequestRejected, match="`n`"):
        _run(service, "n17", n=17)


def test_token_pieces_keep_bytes_of_partial_characters(smollm2_snapshot_bf16: Path) -> None:
    tok = TextTokenizer(smollm2_snapshot_bf16)
    ids = tok.encode("Hi 🦙!")
    pieces = [tok.token_piece(i) for i in ids]
    assert b"".join(bytes(b) for _, b in pieces).decode() == "Hi 🦙!"
    assert any(text == "\ufffd" for text, _ in pieces)  # the llama spans several tokens
    assert tok.token_piece(2) == ("<|im_end|>", tuple(b"<|im_end|>"))  # specials by name


def test_protocol_round_trips_and_old_messages_get_defaults() -> None:
    lp = PositionLogprobs(
        TokenLogprob(5, " a", -0.5, (32, 97)), (TokenLogprob(5, " a", -0.5, (32, 97)),)
    )
    event = GenerateEvent("a", (5,), "stop", Usage(3, 1, 0), index=2, logprobs=(lp,))
    assert GenerateEvent.from_json(json.loads(json.dumps(event.to_json()))) == event
    req = GenerateRequest(
        "r", SamplingParams(n=4, logprobs=2), messages=(ChatMessage("user", "hi"),)
    )
    assert GenerateRequest.from_json(json.loads(json.dumps(req.to_json()))) == req
    old = GenerateEvent.from_json({"text": "x", "token_ids": [1]})
    assert old == GenerateEvent("x", (1,))  # every field not sent takes its default
    assert hash(old) == hash(GenerateEvent("x", (1,)))
    with pytest.raises(FrozenInstanceError):
        old.text = "y"  # type: ignore[misc]
    assert GenerateRequest.from_json({"request_id": "r", "prompt": "p"}).params.n == 1


def test_token_pieces_of_a_sentencepiece_vocabulary(tmp_path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"<unk>": 0, "\u2581the": 1, "<0xE2>": 2, "cat": 3}
    spm = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    spm.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    spm.add_special_tokens([AddedToken("</s>", special=True)])
    spm.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer(tmp_path)
    assert tok.decode([1]) == "the"  # a lone decode drops the leading space...
    assert tok.token_piece(1) == (" the", tuple(b" the"))  # ...logprobs keep it
    assert tok.token_piece(2) == ("\ufffd", (0xE2,))  # one byte of a character
    assert tok.token_piece(3) == ("cat", tuple(b"cat"))
    assert tok.token_piece(4) == ("</s>", tuple(b"</s>"))


def test_an_error_sends_the_text_and_tokens_held_for_a_stop_string(
    smollm2_snapshot_bf16: Path,
) -> None:
    """Text that might begin a stop string waits; a choice that fails meanwhile still
    sends it, with its tokens, before the error (nothing billed goes unsent)."""
    tok = TextTokenizer(smollm2_snapshot_bf16)
    ids = tok.encode(" Hello world")
    params = SamplingParams(max_tokens=8, stop=("dX",))
    choices = Choices(tok, [EngineRequest("r", (1, 2), params, frozenset())], params.stop)
    events = [choices.event(RequestOutput("r", (i,), None, 2)) for i in ids]
    failed = choices.event(RequestOutput("r", (), "error", 2, error="boom"))
    assert failed is not None and failed.finish_reason == "error"
    sent = [e for e in events if e is not None] + [failed]
    assert "".join(e.text for e in sent) == " Hello world"
    assert [t for e in sent for t in e.token_ids] == ids


def _tool_events(tok: TextTokenizer, text: str, stop: str = "stop") -> list[GenerateEvent]:
    """``text`` as a choice streams it token by token, with tool calls parsed (Hermes)."""
    ids = tok.encode(text)
    params = SamplingParams(max_tokens=len(ids))
    choices = Choices(tok, [EngineRequest("r", (1, 2), params, frozenset())], (), "hermes")
    events = [choices.event(RequestOutput("r", (i,), None, 2)) for i in ids[:-1]]
    events.append(choices.event(RequestOutput("r", (ids[-1],), stop, 2)))  # type: ignore[arg-type]
    return [e for e in events if e is not None]


def test_tool_calls_leave_the_content_and_every_token_is_still_sent(
    smollm2_snapshot_bf16: Path,
) -> None:
    tok = TextTokenizer(smollm2_snapshot_bf16)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"Checking.\n<tool_call>\n{call}\n</tool_call>"
    events = _tool_events(tok, text)
    assert "".join(e.text for e in events) == "Checking."
    assert [t for e in events for t in e.token_ids] == tok.encode(text)  # all billed, all sent
    pieces = [p for e in events for p in e.tool_calls]
    assert [p["function"] for p in pieces] == [
        {"name": "get_weather", "arguments": ""},
        {"arguments": '{"city":"Paris"}'},
    ]
    assert events[-1].finish_reason == "tool_calls"
    assert events[-1].usage == Usage(2, len(tok.encode(text)))
    # Cut by max_tokens, a choice that called a tool still finished by length.
    assert _tool_events(tok, text, "length")[-1].finish_reason == "length"
    # No call, no change: plain text stops as ever.
    plain = _tool_events(tok, "No tools needed.")
    assert ("".join(e.text for e in plain), plain[-1].finish_reason) == ("No tools needed.", "stop")


def test_a_named_tool_is_called_whatever_the_model(service: WorkerService) -> None:
    """Random weights, and still the call: the grammar holds it to the tool's schema."""
    tool = {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {"color": {"enum": ["red", "blue"]}},
                "required": ["color"],
                "additionalProperties": False,
            },
        },
    }
    chat = (ChatMessage("user", "Pick a color."),)
    req = GenerateRequest("tool-1", SamplingParams(max_tokens=64, seed=1), None, chat,
                          json.dumps([tool]), "pick")  # fmt: skip

    async def collect() -> list[GenerateEvent]:
        return [e async for e in service.generate(req)]

    events = asyncio.run(collect())
    pieces = [p for e in events for p in e.tool_calls]
    assert [p["function"].get("name") for p in pieces] == ["pick", None]
    assert json.loads(pieces[1]["function"]["arguments"])["color"] in ("red", "blue")
    assert "".join(e.text for e in events) == ""
    assert events[-1].finish_reason == "tool_calls"
    assert events[-1].usage is not None
    assert events[-1].usage.completion_tokens == sum(len(e.token_ids) for e in events)
