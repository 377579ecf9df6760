"""OpenAI tools for chat templates: how a model is told about its tools, how its calls look,
and the grammar that makes it call one.

Two call formats, after what the model's chat template teaches it:

- ``hermes`` (Hermes 2 Pro, Qwen 2.5/3, and the default): ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>``, one block per call;
- ``llama3_json`` (Llama 3.1+, whose template mentions ``<|python_tag|>`` or describes
  ``"parameters"`` with the ``ipython`` role): the output is ``{"name": ..., "parameters":
  {...}}``, calls separated by ``;``.

A template that mentions ``tools`` renders them itself (``tools=[...]``, as HF's
``apply_chat_template(tools=...)`` passes them, with each assistant call's ``arguments``
parsed into a dict, as vLLM does: templates write ``arguments | tojson``). For one that does
not (SmolLM2's plain ChatML), :func:`template_messages` does what llama.cpp and vLLM users
expect: the tools go into the system message in the Hermes format, earlier calls become
``<tool_call>`` text of their assistant turn, and tool results user turns of
``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from hotpool.worker.protocol import ChatMessage, message_json
from hotpool.worker.structured.schemas import closed_objects

ToolFormat = Literal["hermes", "llama3_json"]
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
LLAMA3_SEPARATOR = "; "
# As llguidance's JSON for response formats (structured/grammar.py): no free whitespace.
_COMPACT = {"whitespace_flexible": False}
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def template_knows_tools(source: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return source is not None and "tools" in source


def tool_format(source: str | None) -> ToolFormat:
    """The call format a chat template teaches (Hermes unless it is Llama 3.1+'s)."""
    if source is None or not template_knows_tools(source):
        return "hermes"
    llama3 = "<|python_tag|>" in source or ('"parameters"' in source and "ipython" in source)
    return "llama3_json" if llama3 else "hermes"


def compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The ``function`` object of an OpenAI tool (validated by the control plane)."""
    function = tool.get("function")
    return function if isinstance(function, dict) else {}


def template_messages(
    messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None, knows_tools: bool
) -> list[dict[str, Any]]:
    """The messages as the chat template gets them. ``knows_tools``: the template renders
    ``tools`` and tool turns itself; otherwise they are written into the messages in the
    Hermes format (and ``tools``, when given, into the system message)."""
    if knows_tools:
        return [_native(m) for m in messages]
    out: list[dict[str, Any]] = []
    results = False  # the last turn holds tool results: the next result joins it
    for m in messages:
        if m.role == "tool":
            response = f"<tool_response>\n{m.content}\n</tool_response>"
            if results:  # parallel calls' results: one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            results = True
            continue
        results = False
        if m.tool_calls is not None:
            calls = [
                f"{HERMES_START}\n{_hermes_json(c)}\n{HERMES_END}" for c in _calls(m.tool_calls)
            ]
            text = "\n".join(([m.content] if m.content else []) + calls)
            out.append({**message_json(m), "content": text})
        else:
            out.append(message_json(m))
    if tools:
        prompt = hermes_system_prompt(tools)
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{prompt}" if first else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def hermes_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The instruction that tells a model without a tools template about its tools."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more of these functions to help with the user's "
        "request. Their signatures are within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, return a JSON object with its name and arguments within "
        "<tool_call></tool_call> XML tags, one block per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _native(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = message_json(m)
    if m.tool_calls is not None:
        out["tool_calls"] = _calls(m.tool_calls)
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _calls(text: str) -> list[dict[str, Any]]:
    """An assistant message's calls with ``arguments`` parsed (the control plane checked that
    each is a JSON object's text)."""
    calls = json.loads(text)
    for call in calls:
        function = call["function"]
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    return calls  # type: ignore[no-any-return]


def _hermes_json(call: dict[str, Any]) -> str:
    f = call["function"]
    return json.dumps({"name": f["name"], "arguments": f["arguments"]}, ensure_ascii=False)


# --- the grammar of a call that must happen -------------------------------------------------


def tool_constraint(
    tools: Sequence[dict[str, Any]], choice: str, parallel: bool, fmt: ToolFormat
) -> str | None:
    """The grammar constraint (``{"type": "lark", ...}`` text for
    :class:`~hotpool.worker.structured.grammar.GrammarCompiler`) of a ``tool_choice``:
    ``required``, one call of any tool (one or more with ``parallel``); a function's name,
    exactly one call of it. None for ``auto`` and ``none``: the model is free. Each call's
    arguments follow its function's ``parameters`` schema, its objects closed
    (:func:`~hotpool.worker.structured.schemas.closed_objects`) whether ``strict`` or not:
    the arguments become a function's keyword arguments, and a key it does not name breaks
    the call. An object takes other keys only where its schema says so
    (``additionalProperties: true`` or a schema for them)."""
    if choice in ("auto", "none"):
        return None
    functions = [function_of(t) for t in tools]
    if choice != "required":
        functions = [f for f in functions if f.get("name") == choice]
        parallel = False
    if not functions:
        return None  # the control plane names the function: not reached
    key = "parameters" if fmt == "llama3_json" else "arguments"
    rules = [f"f{i}: %json {json.dumps(_call_schema(f, key))}" for i, f in enumerate(functions)]
    alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
    if fmt == "llama3_json":
        call, separator = f"call: {alternatives}", json.dumps(LLAMA3_SEPARATOR)
    else:
        opening, closing = json.dumps(HERMES_START + "\n"), json.dumps("\n" + HERMES_END)
        call = f"call: {opening} ({alternatives}) {closing}"
        separator = json.dumps("\n")
    start = f"start: call ({separator} call)*" if parallel else "start: call"
    grammar = "\n".join([start, call, *rules])
    return json.dumps({"type": "lark", "grammar": grammar, "where": "tools"})


def _call_schema(function: dict[str, Any], key: str) -> dict[str, Any]:
    """The JSON schema of one call: its name, and its arguments under ``key``."""
    parameters = function.get("parameters")
    if parameters is None:
        arguments: dict[str, Any] = NO_ARGUMENTS
    else:
        # Its local references now start under the call's key.
        closed = closed_objects({"type": "object", **parameters})
        arguments = _rebase(closed, f"#/properties/{key}")
    return {
        "type": "object",
        "properties": {"name": {"const": function.get("name")}, key: arguments},
        "required": ["name", key],
        "additionalProperties": False,
        "x-guidance": _COMPACT,
    }


_VALUES = {"const", "enum", "default", "examples"}  # keywords whose values are data
_NAMED = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def _rebase(schema: Any, root: str) -> Any:
    """``schema`` with each local ``$ref`` (``#``, ``#/...``) moved under ``root``."""
    if not isinstance(schema, dict):
        return schema  # true or false
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = root + v[1:]
        elif k in _VALUES:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):  # names -> schemas
            out[k] = {name: _rebase(s, root) for name, s in v.items()}
        elif isinstance(v, list):  # allOf, anyOf, prefixItems...; `required` is unchanged
            out[k] = [_rebase(s, root) for s in v]
        else:
            out[k] = _rebase(v, root)
    return out
