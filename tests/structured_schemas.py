"""Twenty JSON schemas of the shapes pipelines ask for (nested objects, arrays with item
bounds, enums, optional fields, bounded numbers, string patterns), each with a prompt: the
structured-output tests and benchmarks/bench_structured.py share them. Strings are bounded
(``maxLength``), and so are integers (``maximum``) and decimals (``multipleOf``): a weak
model repeats digits forever at temperature 0 and draws them forever at 1, JSON that is
valid so far and never closes before ``max_tokens``. Each ``multipleOf`` is a binary
fraction: jsonschema divides in floats and refuses 42.91 as a multiple of 0.01."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 40}
DEGREES = {"type": "number", "multipleOf": 0.125}
COORD = {"type": "integer", "minimum": -100, "maximum": 100}

SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Describe a person.", {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    }),
    ("city", "Tell me about Paris.", {
        "type": "object",
        "properties": {
            "city": NAME, "country": NAME,
            "population": {"type": "integer", "minimum": 1, "maximum": 40000000},
        },
        "required": ["city", "country", "population"],
    }),
    ("colors", "List some colors.", {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4}},
        "required": ["colors"],
    }),
    ("sentiment", "Classify: I love this product!", {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        },
        "required": ["label", "confidence"],
    }),
    ("optional", "Give a book.", {
        "type": "object",
        "properties": {
            "title": NAME, "subtitle": SHORT,
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        },
        "required": ["title"],
    }),
    ("nested", "Describe an order.", {
        "type": "object",
        "properties": {
            "customer": {
                "type": "object",
                "properties": {"name": NAME, "vip": {"type": "boolean"}},
                "required": ["name", "vip"],
            },
            "items": {
                "type": "array", "minItems": 1, "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                },
            },
        },
        "required": ["customer", "items"],
    }),
    ("date", "When was the moon landing?", {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
    }),
    ("email", "Make up a contact.", {
        "type": "object",
        "properties": {
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
            "phone": {"type": "string", "pattern": "^\\+[0-9]{6,12}$"},
        },
        "required": ["email", "phone"],
    }),
    ("bools", "Answer yes or no: is water wet?", {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}, "reason": SHORT},
        "required": ["answer"],
    }),
    ("numbers", "Give three measurements.", {
        "type": "object",
        "properties": {
            "values": {
                "type": "array", "minItems": 3, "maxItems": 3,
                "items": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.5},
            },
        },
        "required": ["values"],
    }),
    ("exclusive", "Pick a percentage.", {
        "type": "object",
        "properties": {"pct": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
        "required": ["pct"],
    }),
    ("enum_array", "Which days are weekend days?", {
        "type": "object",
        "properties": {
            "days": {
                "type": "array", "minItems": 1, "maxItems": 2,
                "items": {"enum": ["Saturday", "Sunday", "Monday"]},
            },
        },
        "required": ["days"],
    }),
    ("const", "Report status.", {
        "type": "object",
        "properties": {"version": {"const": 2}, "status": {"enum": ["ok", "degraded"]}},
        "required": ["version", "status"],
    }),
    ("nullable", "Give a middle name if any.", {
        "type": "object",
        "properties": {"first": NAME, "middle": {"type": ["string", "null"], "maxLength": 16}},
        "required": ["first", "middle"],
    }),
    ("anyof", "Give an ID.", {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                           {"type": "string", "maxLength": 8}]},
        },
        "required": ["id"],
    }),
    ("ref", "Describe two points.", {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": COORD, "y": COORD},
                "required": ["x", "y"],
            },
        },
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    }),
    ("matrix", "Write a 2x2 matrix.", {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array", "minItems": 2, "maxItems": 2,
                "items": {
                    "type": "array", "minItems": 2, "maxItems": 2,
                    "items": {"type": "integer", "minimum": -9, "maximum": 9},
                },
            },
        },
        "required": ["rows"],
    }),
    ("recipe", "Give a recipe.", {
        "type": "object",
        "properties": {
            "title": NAME,
            "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
            "steps": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3},
            "vegan": {"type": "boolean"},
        },
        "required": ["title", "minutes", "steps", "vegan"],
        "additionalProperties": False,
    }),
    ("top_array", "List two animals.", {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {
            "type": "object",
            "properties": {"animal": NAME, "legs": {"enum": [0, 2, 4, 6, 8]}},
            "required": ["animal", "legs"],
        },
    }),
    ("deep", "Describe a company.", {
        "type": "object",
        "properties": {
            "company": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "hq": {
                        "type": "object",
                        "properties": {
                            "city": NAME,
                            "geo": {
                                "type": "object",
                                "properties": {
                                    "lat": {**DEGREES, "minimum": -90, "maximum": 90},
                                    "lon": {**DEGREES, "minimum": -180, "maximum": 180},
                                },
                                "required": ["lat", "lon"],
                            },
                        },
                        "required": ["city", "geo"],
                    },
                },
                "required": ["name", "hq"],
            },
        },
        "required": ["company"],
    }),
]  # fmt: skip
