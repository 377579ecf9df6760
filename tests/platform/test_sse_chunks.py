"""The SSE body of a streamed completion, chunk by chunk: text chunks take a pre-encoded
envelope (the fast path), the rest go through the general encoder; a client must not be
able to tell which was which."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

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
    header, arguments = TOOL_EVENTS[2].tool_calls
    assert first[0]["choices"][0]["delta"] == {
        "role": "assistant", "content": None, "tool_calls": [header]
    }  # fmt: skip
    assert first[1]["choices"][0]["delta"] == {"tool_calls": [arguments]}


def test_streamed_tool_calls_come_in_openais_order_for_any_client() -> None:
    """As OpenAI streams a call: a chunk with its header (``id``, ``type``, ``name``, empty
    ``arguments``), then chunks with its arguments; never two entries of one call in one
    chunk (a client that read ``delta.tool_calls[0]`` saw the header and lost the
    arguments). The openai package's own accumulator gets each call whole."""
    chunks = _stream(_call(True, 1, False, "tiny"), TOOL_EVENTS)
    started: set[int] = set()
    first_entries: dict[int, dict[str, str]] = {}  # what reading tool_calls[0] gives
    for c in chunks:
        entries = c["choices"][0]["delta"].get("tool_calls", [])
        assert len({e["index"] for e in entries}) == len(entries), entries
        for e in entries:
            if e["index"] in started:  # after its header, only arguments
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
            else:
                assert e["id"] and e["type"] == "function" and e["function"]["arguments"] == ""
                started.add(e["index"])
        if entries:
            e = entries[0]
            call = first_entries.setdefault(e["index"], {"name": "", "arguments": ""})
            call["name"] += e["function"].get("name", "")
            call["arguments"] += e["function"]["arguments"]
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in CALLS]
    assert [(c["name"], c["arguments"]) for c in first_entries.values()] == want

    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    events = [e for c in chunks for e in state.handle_chunk(ChatCompletionChunk.model_validate(c))]
    message = state.get_final_completion().choices[0].message
    assert message.content == "Let me look."
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        (c["id"], *w) for c, w in zip(CALLS, want, strict=True)
    ]
    done = [(e.name, e.arguments) for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done == want


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
