"""Tool calling end to end with the official openai client: SmolLM2 behind ``hotpool serve``
calls a tool when it must (``required``, or a named function), its arguments valid against
the function's schema; the client sends the result back, and the model answers."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_process import Server

pytestmark = pytest.mark.slow

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current time in UTC."},
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _valid(name: str, arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    schema = next(t for t in (WEATHER, TIME) if t["function"]["name"] == name)["function"]
    jsonschema.validate(args, schema.get("parameters", {"type": "object", "maxProperties": 0}))
    return args  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_tool_round_trip(server: Server, choice: Any) -> None:
    client = _client(server)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", messages=QUESTION, tools=[WEATHER, TIME], tool_choice=choice,
        temperature=0, max_tokens=64, parallel_tool_calls=False,
    )  # fmt: skip
    response = raw.parse()
    choice0 = response.choices[0]
    assert choice0.finish_reason == "tool_calls", choice0
    calls = choice0.message.tool_calls
    assert calls and len(calls) == 1 and choice0.message.content is None
    call = calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    _valid(call.function.name, call.function.arguments)
    row = server.ledger_row(raw.headers["x-request-id"])
    assert response.usage is not None and row.status == "completed"
    assert (row.prompt_tokens, row.completion_tokens) == (
        response.usage.prompt_tokens,
        response.usage.completion_tokens,
    )

    # The client runs the tool and sends the result back; the model answers in words.
    messages = [
        *QUESTION,
        choice0.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees celsius."},
    ]
    answer = client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER, TIME], tool_choice="none",
        temperature=0, max_tokens=32,
    )  # fmt: skip
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_streamed_tool_call(server: Server) -> None:
    client = _client(server)
    with client.chat.completions.with_streaming_response.create(
        model="smollm2", messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
        temperature=0, max_tokens=64, stream=True, stream_options={"include_usage": True},
        parallel_tool_calls=False,
    ) as raw:  # fmt: skip
        request_id = raw.headers["x-request-id"]
        chunks = list(raw.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            pieces = choice.delta.tool_calls or []
            # OpenAI's order: one entry per call in a chunk, its header (id, type, name and
            # empty arguments) first, then its arguments alone.
            assert len({p.index for p in pieces}) == len(pieces), pieces
            for piece in pieces:
                assert piece.function is not None
                if piece.index in calls:
                    assert piece.id is None and piece.function.name is None
                else:
                    assert piece.type == "function" and piece.function.arguments == ""
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.id or ""
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    assert calls and all(c["id"].startswith("call_") for c in calls.values())
    for c in calls.values():
        _valid(c["name"], c["arguments"])
    # The openai package's own accumulator (what its `.stream()` helpers run) agrees.
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    message = state.get_final_completion().choices[0].message
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        (c["id"], c["name"], c["arguments"]) for c in calls.values()
    ]
    finishes = [c.finish_reason for k in chunks for c in k.choices if c.finish_reason]
    assert finishes == ["tool_calls"]
    usage = chunks[-1].usage
    assert usage is not None
    row = server.ledger_row(request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (
        "completed", usage.prompt_tokens, usage.completion_tokens,
    )  # fmt: skip


def test_auto_may_answer_in_words_and_none_never_calls(server: Server) -> None:
    client = _client(server)
    for choice in ("auto", "none"):
        response = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
            tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=16,
        )  # fmt: skip
        message = response.choices[0].message
        assert message.content or message.tool_calls
        if choice == "none":
            assert not message.tool_calls and response.choices[0].finish_reason != "tool_calls"


def test_parallel_calls_are_each_valid(server: Server) -> None:
    """``required`` with parallel calls allowed: one or more calls, each valid (a small
    model may go on calling until ``max_tokens``: then it finished by length)."""
    response = _client(server).chat.completions.create(
        model="smollm2", messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
        temperature=0, max_tokens=96,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    calls = choice.message.tool_calls or []
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        _valid(call.function.name, call.function.arguments)
