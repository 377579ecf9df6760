"""Structured outputs through the worker with SmolLM2 (a weak model: the grammar, not the
model, makes the JSON valid): twenty schemas at temperature 0 and 1, JSON mode, a batch
where constrained and free requests run together, the compile cache, and schema errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch
from structured_schemas import SCHEMAS

from hotpool.worker.engine.async_engine import AsyncEngine
from hotpool.worker.engine.base import RequestRejected
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.host_cache import HostKey
from hotpool.worker.models.loader import load_model
from hotpool.worker.protocol import ChatMessage, GenerateEvent, GenerateRequest, SamplingParams
from hotpool.worker.service import LoadedModel, WorkerService
from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.tokenizer import TextTokenizer

CPU = torch.device("cpu")
SYSTEM = ChatMessage("system", "Answer with JSON only.")


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[WorkerService]:
    tok = TextTokenizer(smollm2_snapshot_bf16)
    model = load_model(smollm2_snapshot_bf16, CPU, torch.bfloat16)
    engine = LLMEngine(model, CPU, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=64))
    svc = WorkerService(SnapshotCache(tmp_path_factory.mktemp("cache")), CPU)
    svc.loaded = LoadedModel(
        "d", "digest", tok, AsyncEngine(engine), model, HostKey("digest", "bf16"), False
    )
    yield svc
    svc.loaded.engine.shutdown()


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
