"""Structured outputs through a live ``hotpool serve`` and the official openai client:
``parse()`` with a pydantic model, json_schema streamed and not, JSON mode on the native
invoke route, the ledger's usage, and schema errors as 400s that name the path."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from server_process import Server
from structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_parse_with_a_pydantic_model_returns_the_object(client: OpenAI) -> None:
    done = client.chat.completions.parse(
        model="smollm2",
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format=City,
        temperature=0,
        max_tokens=100,
    )
    city = done.choices[0].message.parsed
    assert isinstance(city, City)
    assert done.choices[0].finish_reason == "stop"


def test_a_schema_streamed_and_not_validates_and_is_billed(client: OpenAI, server: Server) -> None:
    name, prompt, schema = SCHEMAS[5]  # nested objects in an array
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": prompt}]
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", messages=messages, response_format=fmt, temperature=1.0, seed=3,
        max_tokens=300,
    )  # fmt: skip
    full = raw.parse()
    text = full.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), schema)
    row = server.ledger_row(raw.headers["x-request-id"])
    assert full.usage is not None
    assert (row.prompt_tokens, row.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    stream = client.chat.completions.create(
        model="smollm2", messages=messages, response_format=fmt, temperature=1.0, seed=3,
        max_tokens=300, stream=True,
    )  # fmt: skip
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed), schema)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_mode_on_the_native_invoke_route(server: Server) -> None:
    server.deploy("smollm2")
    body = {
        "messages": [{"role": "user", "content": "Describe a dog."}],
        "params": {"response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 200},
    }
    r = httpx.post(f"{server.url}/v1/deployments/smollm2/invoke", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["outputs"][0]["text"]), dict)


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "schema.properties.a.type"),
        ({"type": "object", "properties": {"a": {"not": {}}}}, "schema.properties.a"),
    ],
)
def test_a_bad_schema_is_a_400_naming_where(client: OpenAI, schema: object, where: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "x"}], response_format=fmt
        )
    assert where in str(err.value)
