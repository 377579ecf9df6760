"""The SSE body of a streamed completion, chunk by chunk: text chunks take a pre-encoded
envelope (the fast path), the rest go through the general encoder; a client must not be
able to tell which was which."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hotpool.platform.openai_routes import _Shape, _sse
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


def _stream(call: CompletionCall) -> list[dict[str, Any]]:
    n = call.params.n
    events = [GenerateEvent(index=i % n, text=t, token_ids=[1]) for i, t in enumerate(TEXTS)]
    events += [GenerateEvent(index=i, finish_reason="length", usage=Usage(3, 6)) for i in range(n)]

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
