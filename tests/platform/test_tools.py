"""OpenAI's tools in a chat request: what passes on to the worker, and the 400 that names
each bad part (``tools[0].function.parameters``, ``messages[1].tool_calls[0].id``...)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hotpool.platform.errors import APIError, invalid
from hotpool.platform.schema_checks import check_texts, request_schemas
from hotpool.platform.schemas import parse_chat
from hotpool.worker.protocol import ChatMessage, GenerateRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
        "strict": True,
    },
}
TIME = {"type": "function", "function": {"name": "get-time"}}
USER = {"role": "user", "content": "Weather in Paris?"}
CHAT: dict[str, Any] = {"model": "m", "messages": [USER], "tools": [WEATHER, TIME]}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def test_tools_and_the_choice_reach_the_call_as_compact_json() -> None:
    call = parse_chat({**CHAT, "tool_choice": "required", "parallel_tool_calls": False})
    assert call.tools is not None and json.loads(call.tools) == [WEATHER, TIME]
    assert " " not in call.tools.replace("The weather in a city.", "")
    assert (call.tool_choice, call.parallel_tool_calls) == ("required", False)
    named = {"type": "function", "function": {"name": "get-time"}}
    assert parse_chat({**CHAT, "tool_choice": named}).tool_choice == "get-time"


def test_the_choice_defaults_to_auto_with_tools_and_none_without() -> None:
    assert parse_chat(CHAT).tool_choice == "auto"
    assert parse_chat(CHAT).parallel_tool_calls is True
    plain = parse_chat({"model": "m", "messages": [USER]})
    assert (plain.tools, plain.tool_choice) == (None, "none")
    for empty in ([], None):  # SDKs send the fields empty or null
        call = parse_chat({"model": "m", "messages": [USER], "tools": empty, "tool_choice": "auto"})
        assert (call.tools, call.tool_choice) == (None, "none")


def test_a_tool_round_trip_conversation_is_accepted() -> None:
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Sunny"}]},
    ]
    call = parse_chat({**CHAT, "messages": messages})
    assert call.messages is not None
    assistant, tool = call.messages[1:]
    assert assistant == ChatMessage(
        "assistant", "", tool_calls=json.dumps([CALL], separators=(",", ":"))
    )
    assert tool == ChatMessage("tool", "Sunny", tool_call_id="call_1")


def test_the_worker_request_carries_the_tools() -> None:
    call = parse_chat({**CHAT, "tool_choice": "required"})
    req = GenerateRequest("r", call.params, None, call.messages, call.tools, call.tool_choice,
                          call.parallel_tool_calls)  # fmt: skip
    back = GenerateRequest.from_json(json.loads(json.dumps(req.to_json())))
    assert back == req


def _rejects(body: dict[str, Any], param: str) -> str:
    """The 400 for ``body``: from parsing it, or from checking its schemas (which the
    routes run off the event loop, hotpool.platform.schema_checks)."""
    with pytest.raises(APIError) as info:
        verdict = check_texts(request_schemas(parse_chat(body)))
        if verdict.message is not None:
            raise invalid(verdict.message, verdict.param)
    assert info.value.status == 400
    assert info.value.param == param, info.value.message
    return info.value.message


def _tool(**function: Any) -> dict[str, Any]:
    return {**CHAT, "tools": [{"type": "function", "function": function}]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "tools": [WEATHER] * 129}, "tools"),
        ({**CHAT, "tools": ["get_weather"]}, "tools[0].type"),
        ({**CHAT, "tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({**CHAT, "tools": [{**WEATHER, "extra": 1}]}, "tools[0]"),
        ({**CHAT, "tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
        (_tool(), "tools[0].function.name"),
        (_tool(name="has space"), "tools[0].function.name"),
        (_tool(name="x" * 65), "tools[0].function.name"),
        (_tool(name="f", description=3), "tools[0].function.description"),
        (_tool(name="f", strict="yes"), "tools[0].function.strict"),
        (_tool(name="f", returns={}), "tools[0].function"),
        (_tool(name="f", parameters=[]), "tools[0].function.parameters"),
        (_tool(name="f", parameters={"type": "string"}), "tools[0].function.parameters.type"),
        (_tool(name="f", parameters={"type": "object", "properties": 5}),
         "tools[0].function.parameters"),
        ({**CHAT, "tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({**CHAT, "tool_choice": "any"}, "tool_choice"),
        ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({**CHAT, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "f", "x": 1}}},
         "tool_choice.function"),
        ({**CHAT, "tool_choice": 1}, "tool_choice"),
        ({"model": "m", "messages": [USER], "tool_choice": "required"}, "tool_choice"),
        ({"model": "m", "messages": [USER],
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         "tool_choice"),
        ({**CHAT, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)  # fmt: skip
def test_bad_tools_and_choices_name_the_parameter(body: dict[str, Any], param: str) -> None:
    _rejects(body, param)


def _history(message: dict[str, Any]) -> dict[str, Any]:
    return {**CHAT, "messages": [USER, message]}


def _call(**changes: Any) -> dict[str, Any]:
    return _history({"role": "assistant", "content": None, "tool_calls": [{**CALL, **changes}]})


def _function(**changes: Any) -> dict[str, Any]:
    return _call(function={**CALL["function"], **changes})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_history({"role": "assistant", "content": None}), "messages[1].content"),
        (_history({"role": "assistant", "content": None, "tool_calls": {}}),
         "messages[1].tool_calls"),
        (_history({"role": "assistant", "content": None, "tool_calls": ["x"]}),
         "messages[1].tool_calls[0]"),
        (_call(id=""), "messages[1].tool_calls[0].id"),
        (_call(id=None), "messages[1].tool_calls[0].id"),
        (_call(type="code"), "messages[1].tool_calls[0].type"),
        (_call(function=None), "messages[1].tool_calls[0].function"),
        (_call(extra=1), "messages[1].tool_calls[0]"),
        (_function(name="bad name"), "messages[1].tool_calls[0].function.name"),
        (_function(arguments={"city": "Paris"}), "messages[1].tool_calls[0].function.arguments"),
        (_function(arguments="{bad"), "messages[1].tool_calls[0].function.arguments"),
        (_function(arguments="[1]"), "messages[1].tool_calls[0].function.arguments"),
        (_function(arguments="[" * 100_000), "messages[1].tool_calls[0].function.arguments"),
        (_history({"role": "user", "content": "x", "tool_calls": [CALL]}),
         "messages[1].tool_calls"),
        (_history({"role": "tool", "content": "Sunny"}), "messages[1].tool_call_id"),
        (_history({"role": "tool", "content": "Sunny", "tool_call_id": 7}),
         "messages[1].tool_call_id"),
        (_history({"role": "tool", "content": None, "tool_call_id": "call_1"}),
         "messages[1].content"),
        (_history({"role": "user", "content": "x", "tool_call_id": "call_1"}),
         "messages[1].tool_call_id"),
    ],
)  # fmt: skip
def test_bad_tool_messages_name_the_parameter(body: dict[str, Any], param: str) -> None:
    _rejects(body, param)
