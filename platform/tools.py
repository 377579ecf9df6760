"""OpenAI's function tools in a chat request, checked here; rendered and parsed by the worker.

``tools``: up to :data:`MAX_TOOLS` ``{"type": "function", "function": {"name",
"description"?, "parameters"? (a JSON Schema of an object), "strict"?}}``. ``tool_choice``:
``none``, ``auto`` (the default with tools), ``required`` or ``{"type": "function",
"function": {"name"}}`` naming one of them. ``parallel_tool_calls``: whether a ``required``
choice may make several calls. Messages carry the conversation's calls (an assistant's
``tool_calls``) and their results (``tool`` messages with a ``tool_call_id``). Every
problem is a 400 naming its parameter, down to ``messages[2].tool_calls[0].function.name``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from hotpool.platform.errors import invalid
from hotpool.platform.response_format import MAX_SCHEMA_BYTES

MAX_TOOLS = 128  # as OpenAI allows
MAX_CALL_ID = 256  # characters of a tool call's id
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class ToolSpec:
    """What the worker gets: the tools as compact JSON text (None: no tools), the choice
    (``none``, ``auto``, ``required`` or a function's name) and ``parallel_tool_calls``."""

    tools: str | None = None
    choice: str = "none"
    parallel: bool = True


def parse_tools(tools: Any, choice: Any, parallel: Any) -> ToolSpec:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""
    if tools is not None and not isinstance(tools, list):
        raise invalid(f"`tools` has the wrong type ({type(tools).__name__})", "tools")
    tools = tools or []  # [] asks for nothing, as SDKs that always send the field mean
    if len(tools) > MAX_TOOLS:
        raise invalid(f"`tools` may hold at most {MAX_TOOLS} tools", "tools")
    checked = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"two tools are named {name!r}", f"tools[{i}].function.name")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(
            f"`parallel_tool_calls` has the wrong type ({type(parallel).__name__})",
            "parallel_tool_calls",
        )
    try:
        text = json.dumps(checked, separators=(",", ":")) if checked else None
    except RecursionError:
        raise invalid("a tool's `parameters` nest too deeply", "tools") from None
    if text is not None and len(text) > MAX_SCHEMA_BYTES:
        raise invalid(f"`tools` are larger than {MAX_SCHEMA_BYTES} bytes", "tools")
    return ToolSpec(text, _choice(choice, names), parallel is not False)


def _tool(raw: Any, param: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise invalid(f'`{param}` must be an object with `type` "function"', f"{param}.type")
    _only(raw, {"type", "function"}, param)
    function = raw.get("function")
    where = f"{param}.function"
    if not isinstance(function, dict):
        raise invalid(f"`{where}` is required: an object with a `name`", where)
    _only(function, FUNCTION_FIELDS, where)
    out: dict[str, Any] = {"name": _name(function.get("name"), f"{where}.name")}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise invalid(f"`{where}.description` must be a string", f"{where}.description")
        out["description"] = description
    parameters = function.get("parameters")
    if parameters is not None:
        out["parameters"] = _parameters(parameters, f"{where}.parameters")
    strict = function.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise invalid(f"`{where}.strict` must be a boolean", f"{where}.strict")
        out["strict"] = strict
    return {"type": "function", "function": out}


def _parameters(schema: Any, param: str) -> dict[str, Any]:
    """A function's arguments schema: a JSON Schema of an object, as OpenAI requires."""
    if not isinstance(schema, dict):
        raise invalid(f"`{param}` must be a JSON Schema object", param)
    kind = schema.get("type", "object")
    if kind != "object":
        raise invalid(f'`{param}.type` must be "object": arguments are an object', f"{param}.type")
    return schema  # checked against the metaschema off the event loop (schema_checks)


def _choice(raw: Any, names: list[str]) -> str:
    if raw is None:
        return "auto" if names else "none"
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise invalid(
                f"`tool_choice` must be one of {', '.join(CHOICES)} or a function", "tool_choice"
            )
        if raw == "required" and not names:
            raise invalid('`tool_choice` "required" needs `tools`', "tool_choice")
        return raw if names else "none"
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise invalid(
            '`tool_choice` must be a string or {"type": "function", "function": {"name"}}',
            "tool_choice",
        )
    _only(raw, {"type", "function"}, "tool_choice")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise invalid("`tool_choice.function` must be an object with a `name`", "tool_choice")
    _only(function, {"name"}, "tool_choice.function")
    name = _name(function.get("name"), "tool_choice.function.name")
    if name not in names:
        raise invalid(f"`tool_choice` names {name!r}, which is not in `tools`", "tool_choice")
    if name in CHOICES:  # the worker reads these as the modes
        raise invalid(
            f"a function named {name!r} cannot be chosen by name", "tool_choice.function.name"
        )
    return name


def parse_tool_calls(raw: Any, param: str) -> str | None:
    """An assistant message's ``tool_calls`` as compact JSON text (None: no calls)."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise invalid(f"`{param}` must be a list of at most {MAX_TOOLS} tool calls", param)
    calls = []
    for i, call in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(call, dict):
            raise invalid(f"`{where}` must be an object", where)
        _only(call, {"id", "type", "function"}, where)
        call_id = call.get("id")
        if not isinstance(call_id, str) or not 1 <= len(call_id) <= MAX_CALL_ID:
            raise invalid(f"`{where}.id` must be a string of 1 to {MAX_CALL_ID} characters",
                          f"{where}.id")  # fmt: skip
        if call.get("type") != "function":
            raise invalid(f'`{where}.type` must be "function"', f"{where}.type")
        function = call.get("function")
        if not isinstance(function, dict):
            raise invalid(f"`{where}.function` must be an object", f"{where}.function")
        _only(function, {"name", "arguments"}, f"{where}.function")
        name = _name(function.get("name"), f"{where}.function.name")
        arguments = function.get("arguments")
        try:
            ok = isinstance(arguments, str) and isinstance(json.loads(arguments), dict)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise invalid(
                f"`{where}.function.arguments` must be the JSON text of an object",
                f"{where}.function.arguments",
            )
        calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    return json.dumps(calls, separators=(",", ":"))


def parse_call_id(raw: Any, param: str) -> str:
    """A ``tool`` message's ``tool_call_id``."""
    if not isinstance(raw, str) or not 1 <= len(raw) <= MAX_CALL_ID:
        raise invalid(
            f"`{param}` is required: the id (1 to {MAX_CALL_ID} characters) of the call it answers",
            param,
        )
    return raw


def _name(raw: Any, param: str) -> str:
    if not isinstance(raw, str) or not NAME.fullmatch(raw):
        raise invalid(f"`{param}` must be 1 to 64 letters, digits, underscores or dashes", param)
    return raw


def _only(value: dict[str, Any], allowed: set[str], param: str) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise invalid(f"`{param}` has unsupported fields: {', '.join(unknown)}", param)
