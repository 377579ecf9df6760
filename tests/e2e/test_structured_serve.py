"""Structured outputs through a live ``hotpool serve`` and the official openai client:
``parse()`` with a pydantic model, json_schema streamed and not, JSON mode on the native
invoke route, the ledger's usage, and schema errors as 400s that name the path."""

from __future__ import annotations

import itertools
import json
import threading
import time
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


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _p90(values: list[float]) -> float:
    return sorted(values)[len(values) * 9 // 10]


def _healthz_s(url: str, probes: int = 20) -> list[float]:
    """The times of ``probes`` spaced /healthz answers."""
    times = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(probes):
            t0 = time.perf_counter()
            assert http.get("/healthz").status_code == 200
            times.append(time.perf_counter() - t0)
            time.sleep(0.02)
    return times


def _stream_waits_s(url: str) -> list[float]:
    """A 24-token stream's waits: for its first chunk, then between chunks."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to fifty."}],
            "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    arrivals = [time.perf_counter()]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(arrivals)]


def test_schemas_being_checked_hold_up_no_other_request_or_stream(server: Server) -> None:
    """Issue 46: jsonschema's check of a large schema ran on the control plane's event loop
    (a 50,000-property schema held /healthz for 28 s; two clients looping a 190 KB one made
    its median 10 s and froze streams). Now a schema is sized first and checked elsewhere:
    /healthz and a stream beside a 3 MB schema and two clients looping distinct 190 KB ones
    (each wrong only at its end, so checked whole) stay within 100 ms of their idle times
    (at the 90th percentile: a stall is a few long waits among short ones)."""
    url = server.url
    _stream_waits_s(url)  # a replica is up before anything is timed
    idle_health, idle_gap = _healthz_s(url), _stream_waits_s(url)

    def request(schema: dict[str, object]) -> int:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        body = {"model": "smollm2", "max_tokens": 1, "response_format": fmt,
                "messages": [{"role": "user", "content": "JSON"}]}  # fmt: skip
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code

    def schema(tag: str, properties: int) -> dict[str, object]:
        props: dict[str, object] = {f"{tag}{i}": {"type": "integer"} for i in range(properties)}
        props["last"] = {"type": "strin"}  # a mistake the check finds only at the end
        return {"type": "object", "properties": props}

    statuses: list[int] = []
    stop = threading.Event()

    def loop(client: int) -> None:
        n = 0
        while not stop.is_set():
            statuses.append(request(schema(f"c{client}n{n}p", 5500)))  # ~190 KB, new each time
            n += 1

    threads = [threading.Thread(target=loop, args=(c,)) for c in range(4)]
    huge = threading.Thread(target=lambda: statuses.append(request(schema("h", 90_000))))
    for t in [huge, *threads]:
        t.start()
    try:
        time.sleep(0.5)
        busy_health, busy_gap = _healthz_s(url), _stream_waits_s(url)
    finally:
        stop.set()
        for t in [huge, *threads]:
            t.join(120)
    assert statuses and set(statuses) <= {400, 429}, statuses  # checked, or told to wait
    assert _median(busy_health) < _median(idle_health) + 0.1, (idle_health, busy_health)
    # The stream's first token (a blocked loop held it for seconds), and its tokens after.
    assert busy_gap[0] < idle_gap[0] + 0.1, (idle_gap, busy_gap)
    assert _p90(busy_gap[1:]) < _p90(idle_gap[1:]) + 0.1, (idle_gap, busy_gap)
