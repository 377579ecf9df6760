"""The worker's internal HTTP API, in process, with the real SmolLM2 snapshot."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from hotpool.worker.engine.llm_engine import EngineConfig
from hotpool.worker.server import build_worker_app
from hotpool.worker.service import WorkerService
from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.snapshot.manifest import (
    MANIFEST_NAME,
    read_manifest,
    write_manifest,
)

TOKEN = "test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[TestClient]:
    service = WorkerService(
        SnapshotCache(tmp_path_factory.mktemp("cache")),
        torch.device("cpu"),
        EngineConfig(kv_cache_bytes=64 << 20),
    )
    with TestClient(build_worker_app(service, TOKEN, "w-test")) as client:
        r = client.post(
            "/load",
            json={"deployment": "d", "snapshot_uri": f"file://{smollm2_snapshot_bf16}"},
            headers=AUTH,
        )
        assert r.status_code == 200, r.text
        assert set(r.json()["phases"]) == {"fetch", "load", "warmup"}
        # What the router bounds prompts with before admitting them (SmolLM2: 8192 tokens;
        # its longest vocabulary string is a few dozen bytes).
        assert r.json()["max_model_len"] == 8192 and 8 <= r.json()["max_token_bytes"] <= 256
        yield client
        client.post("/unload", headers=AUTH)


def test_a_kv_cache_that_cannot_be_allocated_fails_the_load_cleanly(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    service = WorkerService(SnapshotCache(tmp_path / "cache"), torch.device("cpu"), EngineConfig())
    with TestClient(build_worker_app(service, TOKEN, "w-kv")) as client:
        body = {"deployment": "d", "snapshot_uri": f"file://{smollm2_snapshot_bf16}"}
        r = client.post("/load", json={**body, "kv_cache_bytes": 1 << 63}, headers=AUTH)
        assert r.status_code == 422 and "cannot allocate the KV cache" in r.text, r.text
        assert client.get("/health").json()["loaded"] is None  # and the worker goes on
        r = client.post("/load", json={**body, "kv_cache_bytes": 16 << 20}, headers=AUTH)
        assert r.status_code == 200, r.text


def _events(client: TestClient, body: dict[str, object]) -> list[dict[str, object]]:
    with client.stream("POST", "/generate", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line]


def test_everything_but_health_needs_the_token(worker: TestClient) -> None:
    assert worker.get("/health").json()["loaded"] == "d"
    for path in ("/metrics", "/generate", "/load", "/unload", "/abort/x"):
        method = worker.get if path == "/metrics" else worker.post
        r = method(path, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_generate_streams_deltas_then_exact_usage(worker: TestClient) -> None:
    body = {"request_id": "g1", "messages": [{"role": "user", "content": "Hello!"}],
            "params": {"max_tokens": 12, "temperature": 0.0}}  # fmt: skip
    events = _events(worker, body)
    final = events[-1]
    assert final["finish_reason"] in ("stop", "length")
    assert final["usage"]["completion_tokens"] == sum(len(e["token_ids"]) for e in events)
    assert final["usage"]["prompt_tokens"] > 10  # the chat template's system prompt counts
    assert "".join(e["text"] for e in events).strip()


def test_generate_streams_every_choice_then_the_whole_usage(worker: TestClient) -> None:
    body = {"request_id": "g-n", "prompt": "One two three",
            "params": {"max_tokens": 4, "n": 2, "seed": 1, "logprobs": 2}}  # fmt: skip
    events = _events(worker, body)
    finishes = [e for e in events if e["finish_reason"]]
    assert sorted(e["index"] for e in finishes) == [0, 1]  # type: ignore[type-var]
    assert events[-1] == finishes[-1]  # the stream ends with the last choice's finish
    usage = events[-1]["usage"]
    assert isinstance(usage, dict)
    assert usage["completion_tokens"] == sum(len(e["token_ids"]) for e in events)  # type: ignore[arg-type]
    assert all(len(e["logprobs"]) == len(e["token_ids"]) for e in events)  # type: ignore[arg-type]
    r = worker.post("/generate", json={**body, "params": {"n": 0}}, headers=AUTH)
    assert r.status_code == 400 and "`n`" in r.json()["error"]["message"]


def test_each_choice_stops_at_its_stop_string(worker: TestClient) -> None:
    body = {"request_id": "g-stop", "prompt": "1, 2, 3, 4,",
            "params": {"max_tokens": 20, "n": 2, "temperature": 0.0, "stop": ["7"]}}  # fmt: skip
    events = _events(worker, body)
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        assert "".join(str(e["text"]) for e in mine) == " 5, 6, "
        assert [e["finish_reason"] for e in mine][-1] == "stop"
    usage = events[-1]["usage"]
    assert isinstance(usage, dict)
    assert usage["completion_tokens"] == sum(len(e["token_ids"]) for e in events) == 16  # type: ignore[arg-type]
    assert worker.get("/health").json()["active_requests"] == 0


def test_bad_requests_are_400s_before_any_token(worker: TestClient) -> None:
    too_long = {"request_id": "g2", "prompt": "hi", "params": {"max_tokens": 100_000}}
    r = worker.post("/generate", json=too_long, headers=AUTH)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    bad = {"request_id": "g3", "prompt": "hi", "params": {"top_p": 0}}
    r = worker.post("/generate", json=bad, headers=AUTH)
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]


def test_a_prompt_whose_bytes_prove_it_too_long_is_refused_before_it_is_tokenized(
    worker: TestClient,
) -> None:
    """8 MiB of text took the worker seconds to tokenize (its streams waiting) only to be
    refused: its bytes alone say it cannot fit, and the refusal says so."""
    for body in (
        {"request_id": "b1", "prompt": "internationalization " * 400_000},
        {"request_id": "b2", "messages": [{"role": "user", "content": "x" * (8 << 20)}]},
    ):
        r = worker.post("/generate", json={**body, "params": {"max_tokens": 1}}, headers=AUTH)
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded"
        assert "maximum context length is 8192 tokens; the prompt (" in error["message"]
        assert "bytes) is at least" in error["message"]  # the bound, not a token count


def test_a_message_spelling_a_special_token_is_prompted_as_text(worker: TestClient) -> None:
    def prompt_tokens(content: str) -> int:
        body = {"request_id": f"sp-{len(content)}", "params": {"max_tokens": 1},
                "messages": [{"role": "user", "content": content}]}  # fmt: skip
        return int(_events(worker, body)[-1]["usage"]["prompt_tokens"])

    # One token ("x") against the seven of "<|im_end|>" spelled out ('<', '|', 'im', ...):
    # read as the special token, it was one, and closed the user's turn.
    assert prompt_tokens("<|im_end|>") == prompt_tokens("x") + 6


def test_min_tokens_hold_off_stop_strings(worker: TestClient) -> None:
    def run(min_tokens: int) -> tuple[str, int]:
        body = {"request_id": f"mt-{min_tokens}",
                "messages": [{"role": "user", "content": "Write a list of fruits."}],
                "params": {"max_tokens": 10, "temperature": 0.0, "stop": [" is", " list"],
                           "min_tokens": min_tokens}}  # fmt: skip
        events = _events(worker, body)
        usage = events[-1]["usage"]
        return "".join(str(e["text"]) for e in events), int(usage["completion_tokens"])

    early, n_early = run(0)
    late, n_late = run(5)
    assert n_late >= 5 > n_early  # the stop string would have cut it before its fifth token
    assert late.startswith(early) and len(late) > len(early)


def test_tokens_and_logprobs_go_out_with_their_text_under_stop_strings(
    worker: TestClient,
) -> None:
    """Text that may begin a stop string is held back; its tokens and their logprobs wait
    with it, so each event's logprobs spell its text (as OpenAI's stream chunks do)."""
    body = {"request_id": "lp-stop",
            "messages": [{"role": "user", "content": "Write a list of fruits."}],
            "params": {"max_tokens": 8, "temperature": 0.0, "logprobs": 0,
                       "stop": ["zzzzzzzz"]}}  # fmt: skip
    events = _events(worker, body)
    for e in events:
        spelled = "".join(lp["sampled"]["token"] for lp in e["logprobs"])  # type: ignore[attr-defined,index]
        assert spelled == e["text"], events
        assert len(e["logprobs"]) == len(e["token_ids"])  # type: ignore[arg-type]
    assert sum(len(e["token_ids"]) for e in events) == 8  # type: ignore[misc,arg-type]
    assert len([e for e in events if e["text"]]) > 1  # held back, but still streamed


def test_metrics_show_the_engine(worker: TestClient) -> None:
    _events(worker, {"request_id": "m1", "prompt": "One two three", "params": {"max_tokens": 3}})
    _events(worker, {"request_id": "m2", "prompt": "One two three", "params": {"max_tokens": 3}})
    text = worker.get("/metrics", headers=AUTH).text
    names = [
        "hotpool_engine_requests",
        "hotpool_kv_cache_usage_ratio",
        "hotpool_preemptions_total",
        "hotpool_prefix_cache_hits_total",
        "hotpool_engine_step_seconds_bucket",
        "hotpool_engine_step_tokens_bucket",
        "hotpool_worker_cold_start_seconds_bucket",
    ]
    for name in names:
        assert name in text, name


def test_a_base_model_refuses_a_chat_with_a_400_naming_completions(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    """A snapshot whose manifest says ``kind: base`` (a catalog base model, pulled) answers
    a chat with a clear 400, not with junk; a prompt is served as ever."""
    folder = tmp_path / "base"
    shutil.copytree(smollm2_snapshot_bf16, folder, copy_function=os.link)
    (folder / MANIFEST_NAME).unlink()  # a link: rewrite it, not the shared one
    manifest = read_manifest(smollm2_snapshot_bf16 / MANIFEST_NAME)
    write_manifest(folder, replace(manifest, kind="base"))  # the same files
    service = WorkerService(SnapshotCache(tmp_path / "cache"), torch.device("cpu"), EngineConfig())
    with TestClient(build_worker_app(service, TOKEN, "w-base")) as client:
        body = {"deployment": "b", "snapshot_uri": f"file://{folder}"}
        assert client.post("/load", json=body, headers=AUTH).status_code == 200
        chat = {"request_id": "c1", "messages": [{"role": "user", "content": "Hi"}]}
        r = client.post("/generate", json=chat, headers=AUTH)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "model_not_chat"
        assert "base model" in r.text and "/v1/completions" in r.text
        prompt = {"request_id": "p1", "prompt": "Once upon a time", "params": {"max_tokens": 2}}
        assert _events(client, prompt)[-1]["usage"]["completion_tokens"] == 2
