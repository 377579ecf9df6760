"""JSON Schema rewrites made before a schema is compiled: closed objects.

A JSON Schema object takes keys it does not name unless it says ``additionalProperties:
false``. Generating, that default is a trap: a weak model invents keys (and a key is a
string it may never close), and a tool's function gets keyword arguments it does not take.
So :func:`closed_objects` closes every object schema that leaves ``additionalProperties``
unsaid, for strict response formats (what ``strict`` means in OpenAI's structured outputs)
and for every tool's arguments (``hotpool.worker.structured.tools``).
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is a subschema, a list of them, or a map of names to them.
_ONE = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "additionalItems",
)
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that let keys other than ``properties`` in: a schema with one is left as it is.
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_COMPOSED = ("allOf", "anyOf", "oneOf")


def closed_objects(schema: Any, shared: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object schema leaves it
    (and the other keywords that admit keys) unsaid: it then takes only the keys it names.

    An object whose keys are spread over several schemas is left open: one that composes
    with ``allOf``/``anyOf``/``oneOf``, and each part of it (``shared``: a branch of
    ``allOf``, or of ``anyOf``/``oneOf`` beside ``properties``). The grammar engine
    intersects the parts, so a closed part would refuse the keys the others name
    (``allOf`` of two closed objects takes only ``{}``)."""
    if isinstance(schema, list):
        return [closed_objects(s, shared) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = closed_objects(out[key], _parts_share_keys(out, key))
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    is_object = out.get("type") == "object" or "properties" in out
    composed = any(k in out for k in _COMPOSED)
    if is_object and not (shared or composed or any(k in out for k in _OPENERS)):
        out["additionalProperties"] = False
    return out


def _parts_share_keys(schema: dict[str, Any], key: str) -> bool:
    """Whether the subschemas under ``key`` each name only some of one object's keys."""
    return key == "allOf" or (key in ("anyOf", "oneOf") and "properties" in schema)
