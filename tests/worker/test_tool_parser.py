"""Tool calls read out of streamed model text: the same calls and content whether the text
comes whole or one character at a time, in the Hermes and Llama 3 JSON formats; what is no
call stays content."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from hotpool.platform.choices import merge_tool_calls
from hotpool.worker.structured.tool_parser import ToolCallParser
from hotpool.worker.structured.tools import ToolFormat

Calls = list[tuple[str, dict[str, Any]]]


def _parse(fmt: ToolFormat, text: str, step: int) -> tuple[str, Calls, list[dict[str, Any]]]:
    """(content, [(name, arguments)], raw pieces) of ``text`` pushed ``step`` chars at a time."""
    parser = ToolCallParser(fmt)
    content, pieces = [], []
    for at in range(0, len(text), step):
        c, p = parser.push(text[at : at + step])
        content.append(c)
        pieces += p
    c, p = parser.flush()
    content.append(c)
    pieces += p
    merged: list[dict[str, Any]] = []
    merge_tool_calls(merged, pieces)
    assert parser.calls == len(merged)
    calls = [(m["function"]["name"], json.loads(m["function"]["arguments"])) for m in merged]
    return "".join(content), calls, pieces


def _both(fmt: ToolFormat, text: str) -> tuple[str, Calls]:
    whole = _parse(fmt, text, len(text) or 1)
    by_char = _parse(fmt, text, 1)
    assert whole[:2] == by_char[:2]
    return whole[0], whole[1]


HERMES = [
    # (model output, content, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {"n": [1, 2]}}\n</tool_call>\n',
     "Let me check.", [("a", {}), ("b", {"n": [1, 2]})]),
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("a", {"x": 1})]),
    ('<tool_call>\n{"name": "a", "parameters": {"x": 1}}\n</tool_call>', "", [("a", {"x": 1})]),
    # cut off before its closing tag (max_tokens), but whole JSON: still a call
    ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}', "", [("a", {"x": 1})]),
    ("Plain answer, no tools.", "Plain answer, no tools.", []),
    ("a < b and <tool or <tool_cal", "a < b and <tool or <tool_cal", []),
    ("Ends with a newline\n", "Ends with a newline\n", []),
    ('Use <tool_call>{"name": "a", "arguments": {}}</tool_call> then answer.',
     "Use then answer.", [("a", {})]),
    ("", "", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes_calls_and_content(text: str, content: str, calls: Calls) -> None:
    assert _both("hermes", text) == (content, calls)


MALFORMED = [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {"x": 1',  # cut off mid-JSON
]


@pytest.mark.parametrize("text", MALFORMED)
def test_a_malformed_hermes_block_stays_content(text: str) -> None:
    assert _both("hermes", text) == (text, [])


def test_content_around_a_bad_block_and_a_good_call() -> None:
    text = 'x <tool_call>oops</tool_call> <tool_call>{"name": "a", "arguments": {}}</tool_call>'
    assert _both("hermes", text) == ("x <tool_call>oops</tool_call>", [("a", {})])


LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}', "", [("a", {})]),
    ('  {"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}', "",
     [("a", {"x": 1}), ("b", {})]),
    ("The weather is sunny.", "The weather is sunny.", []),
    ('Here: {"name": "a", "parameters": {}}', 'Here: {"name": "a", "parameters": {}}', []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
    ('{"name": "a", "parameters": {"x": 1', '{"name": "a", "parameters": {"x": 1', []),
    ('{"name": "a", "parameters": {}} and more', "and more", [("a", {})]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3)
def test_llama3_json_calls_and_content(text: str, content: str, calls: Calls) -> None:
    assert _both("llama3_json", text) == (content, calls)


def test_pieces_have_openai_shape_ids_and_compact_arguments() -> None:
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"city": "Zürich", "n": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    )
    _, _, pieces = _parse("hermes", text, 1)
    first, args, second, _ = pieces
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", first["id"])
    assert first == {
        "index": 0, "id": first["id"], "type": "function",
        "function": {"name": "a", "arguments": ""},
    }  # fmt: skip
    assert args == {"index": 0, "function": {"arguments": '{"city":"Zürich","n":1}'}}
    assert second["index"] == 1 and second["id"] != first["id"]


def test_text_that_may_open_a_call_is_held_back_until_it_cannot() -> None:
    parser = ToolCallParser("hermes")
    assert parser.push("Hi <tool") == ("Hi", [])  # "<tool" may open a call; " " may precede it
    assert parser.push("box>") == (" <toolbox>", [])
    assert parser.flush() == ("", [])
