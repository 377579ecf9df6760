"""Structured outputs through the worker with SmolLM2 (a weak model: the grammar, not the
model, makes the JSON valid): twenty schemas at temperature 0 and 1, JSON mode, a batch
where constrained and free requests run together, the compile cache, and schema errors.
With a tiny random model behind SmolLM2's tokenizer (the weakest model there is: only the
grammar ends its output): numbers and tool arguments that end where they must."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch
from loaded_service import loaded_service, tiny_service
from structured_schemas import SCHEMAS

from hotpool.platform.choices import merge_tool_calls
from hotpool.worker.engine.base import RequestRejected
from hotpool.worker.engine.llm_engine import EngineConfig
from hotpool.worker.models.loader import load_model
from hotpool.worker.protocol import ChatMessage, GenerateEvent, GenerateRequest, SamplingParams
from hotpool.worker.service import WorkerService
from hotpool.worker.tokenizer import TextTokenizer

CPU = torch.device("cpu")
SYSTEM = ChatMessage("system", "Answer with JSON only.")


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[WorkerService]:
    model = load_model(smollm2_snapshot_bf16, CPU, torch.bfloat16)
    tok = TextTokenizer(smollm2_snapshot_bf16)
    config = EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=64)
    with loaded_service(model, tok, tmp_path_factory.mktemp("cache"), "bf16", config) as svc:
        yield svc


@pytest.fixture(scope="module")
def tiny(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[WorkerService]:
    with tiny_service(smollm2_snapshot_bf16, tmp_path_factory.mktemp("cache")) as svc:
        yield svc


def _schema_format(schema: object) -> str:
    return json.dumps({"type": "json_schema", "schema": schema, "strict": True})


def _request(rid: str, prompt: str, fmt: str | None, **params: object) -> GenerateRequest:
    sampling = SamplingParams(response_format=fmt, **params)  # type: ignore[arg-type]
    return GenerateRequest(rid, sampling, messages=(SYSTEM, ChatMessage("user", prompt)))


def _text(events: list[GenerateEvent]) -> tuple[str, str | None, list[int]]:
    ids = [t for e in events for t in e.token_ids]
    return "".join(e.text for e in events), events[-1].finish_reason, ids


def _run_all(service: WorkerService, reqs: list[GenerateRequest]) -> list[list[GenerateEvent]]:
    async def one(req: GenerateRequest) -> list[GenerateEvent]:
        return [e async for e in service.generate(req)]

    async def run() -> list[list[GenerateEvent]]:
        return list(await asyncio.gather(*map(one, reqs)))

    return asyncio.run(run())


@pytest.mark.slow
def test_twenty_schemas_at_temperature_0_and_1_always_validate(service: WorkerService) -> None:
    reqs = [
        _request(f"{name}-{t}", prompt, _schema_format(schema), temperature=t, max_tokens=400)
        for name, prompt, schema in SCHEMAS
        for t in (0.0, 1.0)
    ]
    outs = _run_all(service, reqs)
    for req, events in zip(reqs, outs, strict=True):
        text, finish, _ = _text(events)
        assert finish == "stop", (req.request_id, text)  # the grammar ended it, not max_tokens
        schema = json.loads(req.params.response_format or "")["schema"]
        jsonschema.validate(json.loads(text), schema)
    # Every schema compiled once, though each ran twice (and the compiler outlives requests).
    assert service.loaded is not None
    assert service.loaded.grammars().compiles == len(SCHEMAS)


def test_json_mode_gives_an_object(service: WorkerService) -> None:
    fmt = json.dumps({"type": "json_object"})
    [events] = _run_all(service, [_request("j", "Describe a cat.", fmt, temperature=0.0,
                                           max_tokens=200)])  # fmt: skip
    text, finish, _ = _text(events)
    assert finish == "stop"
    assert isinstance(json.loads(text), dict)


def test_free_requests_are_unchanged_by_constrained_ones_in_their_batch(
    service: WorkerService,
) -> None:
    free = [
        _request(f"free{i}", p, None, temperature=0.0, max_tokens=24)
        for i, p in enumerate(["Name a fruit.", "What is 2+2?", "Say hello."])
    ]
    alone = [_text(e)[2] for e in _run_all(service, free)]
    _, prompt, schema = SCHEMAS[5]
    constrained = [
        _request(f"c{i}", prompt, _schema_format(schema), temperature=1.0, max_tokens=64, seed=i)
        for i in range(3)
    ]
    mixed = _run_all(service, [*constrained[:2], *free, constrained[2]])
    together = [_text(e)[2] for e in mixed[2:5]]
    assert together == alone


def test_a_schema_the_engine_cannot_express_is_refused_naming_its_path(
    service: WorkerService,
) -> None:
    schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    with pytest.raises(RequestRejected, match=r"schema\.properties\.a` is not supported.*not"):
        _run_all(service, [_request("bad", "x", _schema_format(schema), max_tokens=8)])


def test_a_schema_slower_to_compile_than_the_limit_is_refused_and_the_worker_goes_on(
    service: WorkerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hotpool.worker.service as service_module

    # A limit no compile meets (a compile takes ~1 ms): the request is refused at once.
    monkeypatch.setattr(service_module, "COMPILE_TIMEOUT_S", 1e-6)
    schema = {"type": "object", "properties": {"slow": {"type": "string", "maxLength": 3}}}
    with pytest.raises(RequestRejected, match=r"longer than .* to compile"):
        _run_all(service, [_request("slow", "x", _schema_format(schema), max_tokens=8)])
    monkeypatch.undo()
    # The compile finished in its thread: the same schema now runs from the cache.
    [events] = _run_all(service, [_request("again", "x", _schema_format(schema), max_tokens=40,
                                           temperature=0.0)])  # fmt: skip
    assert events[-1].finish_reason == "stop"
    json.loads(_text(events)[0])


def _choices(events: list[GenerateEvent]) -> dict[int, list[GenerateEvent]]:
    out: dict[int, list[GenerateEvent]] = {}
    for e in events:
        out.setdefault(e.index, []).append(e)
    return out


def test_numbers_end_within_what_a_float64_holds(tiny: WorkerService) -> None:
    """A bounded number at temperature 1: the grammar bounds its integer part, not its
    fraction, and a random model goes on writing digits. Every output is whole JSON within
    ``max_tokens``, its number a finite float64 with at most 17 digits."""
    schema = {
        "type": "object",
        "properties": {"t": {"type": "number", "minimum": -60, "maximum": 60}},
        "required": ["t"],
    }
    req = _request("t", "The temperature?", _schema_format(schema), temperature=1.0,
                   max_tokens=32, seed=3, n=16)  # fmt: skip
    [events] = _run_all(tiny, [req])
    choices = _choices(events)
    assert len(choices) == 16
    for i, choice in choices.items():
        text, finish, _ = _text(choice)
        assert finish == "stop", (i, text)
        value = json.loads(text)["t"]
        assert math.isfinite(value) and -60 <= value <= 60, (i, text)
        assert len(re.sub(r"\D", "", text)) <= 17, (i, text)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        # Not strict, and additionalProperties unsaid; a bounded string, so that the random
        # model's city ends (it would seldom pick the closing quote of ~49k tokens).
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
        },
    },
}


def test_tool_arguments_take_only_the_keys_their_schema_names(tiny: WorkerService) -> None:
    """A required call of a tool whose schema leaves ``additionalProperties`` unsaid, at
    temperature 1: every call's arguments parse, with no key but ``city`` (JSON Schema's
    default let the model invent keys, whose strings it seldom closed)."""
    req = GenerateRequest(
        "tool", SamplingParams(temperature=1.0, max_tokens=64, seed=5, n=8),
        messages=(ChatMessage("user", "What is the weather in Paris?"),),
        tools=json.dumps([WEATHER]), tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    [events] = _run_all(tiny, [req])
    choices = _choices(events)
    assert len(choices) == 8
    for i, choice in choices.items():
        calls: list[dict[str, object]] = []
        merge_tool_calls(calls, [p for e in choice for p in e.tool_calls])
        assert choice[-1].finish_reason == "tool_calls" and len(calls) == 1, (i, calls)
        arguments = json.loads(calls[0]["function"]["arguments"])  # type: ignore[index]
        assert isinstance(arguments, dict) and set(arguments) <= {"city"}, (i, arguments)
