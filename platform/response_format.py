"""OpenAI's ``response_format``: checked here, compiled into a grammar by the worker.

``text`` asks for nothing; ``json_object`` for any JSON object; ``json_schema`` for JSON
valid against ``json_schema.schema`` (OpenAI's shape: ``{"name", "schema", "strict",
"description"}``). Here the fields and the size are checked; :func:`check_schema`, which
checks the schema against its JSON Schema metaschema (2020-12, the draft OpenAI and the
grammar engine follow) so that a malformed one is a 400 naming the schema path, runs off the
event loop (:mod:`hotpool.platform.schema_checks`); what the grammar engine cannot express
is the worker's 400.
"""

from __future__ import annotations

import json
import re
from typing import Any

from hotpool.platform.errors import invalid

PARAM = "response_format"
MAX_SCHEMA_BYTES = 256 << 10  # a schema is compiled per request: bounded, as OpenAI bounds it
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def parse_response_format(value: Any, param: str = PARAM) -> str | None:
    """The worker's compact JSON for ``value`` (None: free text); a 400 naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(f"`{param}` must be an object with a `type`", param)
    kind = value["type"]
    if kind == "text":
        _only(value, {"type"}, param)
        return None
    if kind == "json_object":
        _only(value, {"type"}, param)
        return json.dumps({"type": "json_object"}, separators=(",", ":"))
    if kind != "json_schema":
        raise invalid(
            f"`{param}.type` must be one of text, json_object, json_schema (got {kind!r})",
            f"{param}.type",
        )
    _only(value, {"type", "json_schema"}, param)
    spec = value.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise invalid(f"`{where}` is required with type json_schema: an object", where)
    _only(spec, {"name", "schema", "strict", "description"}, where)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        why = "must be 1 to 64 letters, digits, underscores or dashes"
        raise invalid(f"`{where}.name` {why}", f"{where}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"`{where}.strict` must be a boolean", f"{where}.strict")
    schema = spec.get("schema", {})  # OpenAI: no schema allows any JSON value
    if not isinstance(schema, dict | bool):
        raise invalid(f"`{where}.schema` must be a JSON Schema (an object)", f"{where}.schema")
    # Sized before it is checked: the check grows with the schema, the size is the bound.
    # Checked against the metaschema later, off the event loop (schema_checks).
    try:
        text = json.dumps(
            {"type": "json_schema", "schema": schema, "strict": bool(strict)},
            separators=(",", ":"),
        )
    except RecursionError:
        raise invalid(f"`{where}.schema` nests too deeply", f"{where}.schema") from None
    if len(text) > MAX_SCHEMA_BYTES:
        raise invalid(f"`{where}.schema` is larger than {MAX_SCHEMA_BYTES} bytes", where)
    return text


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming the path of the first problem when ``schema`` is not a JSON Schema."""
    import jsonschema

    if not isinstance(schema, dict | bool):
        raise invalid(f"`{param}` must be a JSON Schema (an object)", param)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise invalid(f"`{param}{path}` is not a valid JSON Schema: {exc.message}", param) from None
    except (RecursionError, ValueError) as exc:  # a pathological regex, a schema too deep
        raise invalid(f"`{param}` is not a valid JSON Schema: {exc}", param) from None


def _only(value: dict[str, Any], allowed: set[str], param: str) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise invalid(f"`{param}` has unsupported fields: {', '.join(unknown)}", param)
