"""The SSE body of a streamed completion, chunk by chunk: text chunks take a pre-encoded
envelope (the fast path), the rest go through the general encoder; a client must not be
able to tell which was which."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hotpool.platform.openai_routes import _collect, _Shape, _sse
from hotpool.platform.schemas import CompletionCall, parse_chat, parse_completion
from hotpool.worker.protocol import GenerateEvent, Usage

TEXTS = ["Hello", ' "quoted" \\ back', "ünïcödé ✓ 🚀", "\n\t", "null", '"choices": [null]']


def _call(chat: bool, n: int, usage: bool, model: str) -> CompletionCall:
    body: dict[str, Any] = {"model": model, "stream": True, "n": n}
    if usage:
        body["stream_options"] = {"include_usage": True}
    if chat:
        return parse_chat({**body, "messages": [{"role": "user", "content": "x"}]})
    return parse_completion({**body, "prompt": "x"})


def _stream(
    call: CompletionCall, events: list[GenerateEvent] | None = None
) -> list[dict[str, Any]]:
    n = call.params.n
    if events is None:
        events = [GenerateEvent(index=i % n, text=t, token_ids=(1,)) for i, t in enumerate(TEXTS)]
        events += [
            GenerateEvent(index=i, finish_reason="length", usage=Usage(3, 6)) for i in range(n)
        ]

    async def rest() -> AsyncIterator[GenerateEvent]:
        for e in events[1:]:
            yield e

    async def body() -> bytes:
        return b"".join([c async for c in _sse(_Shape(call, "req_1"), call, events[0], rest())])

    text = asyncio.run(body()).decode()
    assert text.endswith("data: [DONE]\n\n")
    chunks = []
    for block in text.split("\n\n")[:-2]:  # the blocks before [DONE]
        assert block.startswith("data: ")
        raw = block.removeprefix("data: ")
        chunk = json.loads(raw)
        assert raw == json.dumps(chunk)  # encoded exactly as json.dumps would
        chunks.append(chunk)
    return chunks


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("usage", [True, False])
@pytest.mark.parametrize("model", ["tiny", 'we"ird", "choices": [null]'])
def test_text_chunks_carry_the_text_in_the_same_envelope_as_every_chunk(
    chat: bool, n: int, usage: bool, model: str
) -> None:
    call = _call(chat, n, usage, model)
    chunks = _stream(call)
    texts: dict[int, str] = {}
    for c in chunks:
        assert c["id"] == ("chatcmpl-1" if chat else "cmpl-1") and c["model"] == model
        assert c["object"] == ("chat.completion.chunk" if chat else "text_completion")
        assert ("usage" in c) == usage
        for choice in c["choices"]:
            assert choice["logprobs"] is None
            part = choice["delta"].get("content", "") if chat else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + part
    want = {i: "".join(TEXTS[i::n]) for i in range(n)}
    assert texts == want
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"] * n
    if chat:  # each choice's first chunk has the role, the others only content
        firsts = [c["choices"][0]["delta"] for c in chunks[:n]]
        assert all(d.get("role") == "assistant" for d in firsts)
        rest = [ch["delta"] for c in chunks[n:] for ch in c["choices"] if ch["delta"]]
        assert all("role" not in d for d in rest)
    if usage:
        assert chunks[-1]["usage"]["completion_tokens"] == 6 and chunks[-1]["choices"] == []
        assert all(c["usage"] is None for c in chunks[:-1])


def _piece(index: int, name: str | None, arguments: str) -> dict[str, Any]:
    if name is None:
        return {"index": index, "function": {"arguments": arguments}}
    function = {"name": name, "arguments": arguments}
    return {"index": index, "id": f"call_{index}", "type": "function", "function": function}


TOOL_EVENTS = [
    GenerateEvent(text="Let me look.", token_ids=(1, 2)),
    GenerateEvent(token_ids=(3, 4)),  # a call's tokens, its text held by the parser
    GenerateEvent(token_ids=(5,), tool_calls=(_piece(0, "f", ""), _piece(0, None, '{"a":1}'))),
    GenerateEvent(
        token_ids=(6,),
        tool_calls=(_piece(1, "g", ""), _piece(1, None, "{}")),
        finish_reason="tool_calls",
        usage=Usage(3, 6),
    ),
]
CALLS = [
    {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
    {"id": "call_1", "type": "function", "function": {"name": "g", "arguments": "{}"}},
]


def test_streamed_tool_calls_are_delta_tool_calls_and_finish_with_tool_calls() -> None:
    call = _call(True, 1, False, "tiny")
    chunks = _stream(call, TOOL_EVENTS)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "Let me look."}
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    assert pieces == [p for e in TOOL_EVENTS for p in e.tool_calls]
    assert all("content" not in d for d in deltas[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # A choice whose first event is a call: OpenAI's null content beside it.
    first = _stream(call, TOOL_EVENTS[2:])
    assert first[0]["choices"][0]["delta"] == {
        "role": "assistant", "content": None, "tool_calls": list(TOOL_EVENTS[2].tool_calls)
    }  # fmt: skip


def _collected(events: list[GenerateEvent]) -> dict[str, Any]:
    async def rest() -> AsyncIterator[GenerateEvent]:
        for e in events[1:]:
            yield e

    call = _call(True, 1, False, "tiny")
    return asyncio.run(_collect(_Shape(call, "req_1"), events[0], rest()))


def test_a_response_merges_the_pieces_into_message_tool_calls() -> None:
    choice = _collected(TOOL_EVENTS)["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": CALLS,
    }
    assert choice["finish_reason"] == "tool_calls"
    only_calls = _collected(TOOL_EVENTS[1:])["choices"][0]["message"]
    assert only_calls == {"role": "assistant", "content": None, "tool_calls": CALLS}
    plain = _collected([GenerateEvent(text="Hi", finish_reason="stop", usage=Usage(1, 1))])
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
