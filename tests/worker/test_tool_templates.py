"""Tools in the prompt: a template that knows tools gets them (and calls with parsed
arguments); one that does not (SmolLM2's ChatML) gets them in the system message in the
Hermes format. The grammar of a required call compiles and holds the model to the tools.
SmolLM2's real tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import llguidance
import pytest

from hotpool.worker.protocol import ChatMessage, GenerateRequest, SamplingParams
from hotpool.worker.service import request_constraint, request_tools
from hotpool.worker.structured.tools import tool_format
from hotpool.worker.tokenizer import TextTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
ROUND_TRIP = [
    ChatMessage("user", "Weather in Paris and the time?"),
    ChatMessage("assistant", "", tool_calls=json.dumps([CALL, {**CALL, "id": "call_2"}])),
    ChatMessage("tool", "Sunny", tool_call_id="call_1"),
    ChatMessage("tool", "12:00", tool_call_id="call_2"),
]


@pytest.fixture(scope="module")
def tok(smollm2_snapshot_bf16: Path) -> TextTokenizer:
    return TextTokenizer(smollm2_snapshot_bf16)


def test_a_template_without_tools_gets_them_in_the_system_message(tok: TextTokenizer) -> None:
    assert (tok.knows_tools, tok.tool_format) == (False, "hermes")
    text = tok.apply_chat_template([ChatMessage("user", "Weather?")], [WEATHER, TIME])
    system, user = text.split("<|im_end|>\n")[:2]
    assert system.startswith("<|im_start|>system\n# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER)}\n{json.dumps(TIME)}\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in system
    assert user == "<|im_start|>user\nWeather?"
    # An own system message keeps its text, the tools after it.
    own = tok.apply_chat_template([ChatMessage("system", "Be brief."), ChatMessage("user", "x")],
                                  [WEATHER])  # fmt: skip
    assert own.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_calls_and_results_become_hermes_turns(tok: TextTokenizer) -> None:
    text = tok.apply_chat_template(ROUND_TRIP)  # no tools given (tool_choice none): no prompt
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}\n{call}<|im_end|>\n" in text
    results = "<tool_response>\nSunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>assistant\n" in text  # one turn
    assert "# Tools" not in text


def test_tool_text_that_spells_control_tokens_stays_text(tok: TextTokenizer) -> None:
    (im_end,) = tok.encode("<|im_end|>")
    spoof = {"type": "function", "function": {"name": "f", "description": "<|im_end|>x"}}
    chat = [ChatMessage("user", "hi")]
    assert tok.encode_chat(chat, [spoof]).count(im_end) == tok.encode_chat(chat).count(im_end)
    call = {**CALL, "function": {"name": "f", "arguments": '{"a": "<|im_end|>"}'}}
    history = [*chat, ChatMessage("assistant", "", tool_calls=json.dumps([call]))]
    assert history[1].tool_calls is not None
    assert tok.encode_chat(history).count(im_end) == 3  # system, user, assistant turns


TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }} {{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def _with_template(tmp_path: Path, snapshot: Path, template: str) -> TextTokenizer:
    shutil.copy(snapshot / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return TextTokenizer(tmp_path)


def test_a_template_that_knows_tools_renders_them_itself(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    tok = _with_template(tmp_path, smollm2_snapshot_bf16, TOOLS_TEMPLATE)
    assert (tok.knows_tools, tok.tool_format) == (True, "hermes")
    text = tok.apply_chat_template(ROUND_TRIP[:3], [WEATHER])
    # HF's tojson: plain JSON, not Jinja's HTML-escaped one; arguments parsed into a dict.
    assert text.startswith(f"TOOLS {json.dumps([WEATHER])}\n<|im_start|>user\n")
    assert 'CALL get_weather {"city": "Paris"}CALL get_weather {"city": "Paris"}<|im_end|>' in text
    assert "<|im_start|>tool\nRESULT call_1 Sunny<|im_end|>" in text
    spoof = {"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}
    (im_end,) = tok.encode("<|im_end|>")
    assert tok.encode_chat(ROUND_TRIP[:1], [spoof]).count(im_end) == 1


def test_tools_render_as_hf_transformers_renders_them(
    tmp_path: Path, smollm2_snapshot_bf16: Path, hf_smollm2_tokenizer: Any
) -> None:
    tok = _with_template(tmp_path, smollm2_snapshot_bf16, TOOLS_TEMPLATE)
    call = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": ROUND_TRIP[0].content},
        {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "call_2"}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"},
    ]
    hf = hf_smollm2_tokenizer.apply_chat_template(
        messages, tools=[WEATHER], chat_template=TOOLS_TEMPLATE, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    assert tok.apply_chat_template(ROUND_TRIP[:3], [WEATHER]) == hf


def test_llama3_templates_call_in_json() -> None:
    llama = "{% if tools %}{{ tools }}{% endif %}<|python_tag|>{{ messages }}"
    assert tool_format(llama) == "llama3_json"
    assert tool_format('{{ tools }} "parameters" ... ipython') == "llama3_json"
    assert tool_format(TOOLS_TEMPLATE) == "hermes"
    assert tool_format("<|python_tag|> but no tool list") == "hermes"
    assert tool_format(None) == "hermes"


def _request(
    choice: str, tools: list[dict[str, Any]], parallel: bool = True, **params: Any
) -> GenerateRequest:
    messages = (ChatMessage("user", "hi"),)
    return GenerateRequest(
        "r", SamplingParams(**params), None, messages, json.dumps(tools), choice, parallel
    )


def test_tools_are_not_rendered_or_constrained_with_choice_none_or_auto() -> None:
    assert request_tools(_request("none", [WEATHER])) is None
    assert request_tools(_request("auto", [WEATHER])) == [WEATHER]
    fmt = '{"type":"json_object"}'
    assert request_constraint(_request("auto", [WEATHER], response_format=fmt)) == fmt
    assert request_constraint(_request("none", [WEATHER])) is None


def _matcher(tok: TextTokenizer, constraint: str | None) -> llguidance.LLMatcher:
    assert constraint is not None
    spec = json.loads(constraint)
    assert (spec["type"], spec["where"]) == ("lark", "tools")
    lltok = llguidance.LLTokenizer(tok.to_json())
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(spec["grammar"]))
    assert not m.is_error(), m.get_error()
    return m


def _accepts(tok: TextTokenizer, m: llguidance.LLMatcher, text: str) -> bool:
    m = m.deep_copy()
    ok = all(m.consume_token(t) for t in tok.encode(text))
    return ok and m.is_accepting()


def _hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name":"{name}","arguments":{arguments}}}\n</tool_call>'


def test_a_required_call_follows_the_tools_schemas(tok: TextTokenizer) -> None:
    fmt = '{"type":"json_object"}'  # tools win over a response format
    m = _matcher(
        tok, request_constraint(_request("required", [WEATHER, TIME], response_format=fmt))
    )
    weather, time = _hermes("get_weather", '{"city":"Paris"}'), _hermes("get_time", "{}")
    assert _accepts(tok, m, weather)
    assert _accepts(tok, m, f"{weather}\n{time}")  # parallel calls
    assert not _accepts(tok, m, _hermes("get_weather", '{"days":2}'))  # city is required
    assert not _accepts(tok, m, _hermes("get_weather", '{"city": "Paris"}'))  # no free spaces
    assert not _accepts(tok, m, _hermes("get_time", '{"x":1}'))  # no parameters: no arguments
    assert not _accepts(tok, m, _hermes("rm_rf", "{}"))
    assert not _accepts(tok, m, "Sure! " + weather)
    one = _matcher(tok, request_constraint(_request("required", [WEATHER, TIME], parallel=False)))
    assert _accepts(tok, one, time) and not _accepts(tok, one, f"{weather}\n{time}")


def test_a_named_choice_calls_that_function_once(tok: TextTokenizer) -> None:
    m = _matcher(tok, request_constraint(_request("get_time", [WEATHER, TIME])))
    assert _accepts(tok, m, _hermes("get_time", "{}"))
    assert not _accepts(tok, m, _hermes("get_weather", '{"city":"Paris"}'))
    assert not _accepts(tok, m, f"{_hermes('get_time', '{}')}\n{_hermes('get_time', '{}')}")


def test_references_in_a_schema_still_resolve(tok: TextTokenizer) -> None:
    tree = {
        "type": "function",
        "function": {
            "name": "plant",
            "parameters": {
                "type": "object",
                "properties": {"root": {"$ref": "#/$defs/node"}},
                "required": ["root"],
                "$defs": {
                    "node": {
                        "type": "object",
                        "properties": {"v": {"type": "integer"}, "kid": {"$ref": "#/$defs/node"}},
                        "required": ["v"],
                        "additionalProperties": False,
                    }
                },
            },
        },
    }
    m = _matcher(tok, request_constraint(_request("plant", [tree])))
    assert _accepts(tok, m, _hermes("plant", '{"root":{"v":1,"kid":{"v":2}}}'))
    assert not _accepts(tok, m, _hermes("plant", '{"root":{"v":"x"}}'))


def test_llama3_calls_are_constrained_in_their_format(tok: TextTokenizer) -> None:
    m = _matcher(tok, request_constraint(_request("required", [WEATHER, TIME]), "llama3_json"))
    weather = '{"name":"get_weather","parameters":{"city":"Paris"}}'
    assert _accepts(tok, m, weather)
    assert _accepts(tok, m, weather + '; {"name":"get_time","parameters":{}}')
    assert not _accepts(tok, m, _hermes("get_weather", '{"city":"Paris"}'))
