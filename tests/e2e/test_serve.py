"""hotpool end to end: a real server, real worker processes, SmolLM2, the SQLite ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from openai import OpenAI
from server_process import Server

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


def _chat(server: Server, content: str, **extra: object) -> httpx.Response:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(server.url + CHAT, json=body, timeout=300)


def test_capital_of_france_is_paris_and_the_ledger_holds_its_exact_usage(server: Server) -> None:
    r = _chat(server, "What is the capital of France?", temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    row = server.ledger_row(r.headers["x-request-id"])
    assert (row.prompt_tokens, row.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert (
        row.status == "completed"
        and row.deployment == "smollm2"
        and row.endpoint == "chat.completions"
    )


def test_official_openai_client_streaming_and_not(server: Server) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name three fruits."}]
    full = client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=24
    )
    text = full.choices[0].message.content
    assert text and full.usage and full.usage.completion_tokens <= 24

    stream = client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=24,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: streaming and not give the same answer
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    streamed_usage, full_usage = chunks[-1].usage, full.usage
    assert (streamed_usage.prompt_tokens, streamed_usage.completion_tokens) == (
        full_usage.prompt_tokens,
        full_usage.completion_tokens,
    )
    # The same prompt again: every full 16-token block of it comes from the prefix cache.
    assert (
        streamed_usage.prompt_tokens_details.cached_tokens
        == (full_usage.prompt_tokens - 1) // 16 * 16
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
        0
    ].finish_reason

    done = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert "Paris" in done.choices[0].text and done.usage.completion_tokens == 5
    assert done.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == ["smollm2"]


def test_raw_sse_stream_ends_with_usage_then_done(server: Server) -> None:
    # ignore_eos: sampled at temperature 1, the model may end its answer before 4 tokens
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 4, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        request_id = r.headers["x-request-id"]
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 4
    row = server.ledger_row(request_id)
    assert (row.prompt_tokens, row.completion_tokens) == (usage["prompt_tokens"], 4)


def test_client_that_disconnects_is_billed_for_what_it_got(server: Server) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=300) as r:
        request_id = r.headers["x-request-id"]
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 4:
                break  # leave mid-stream
    row = server.ledger_row(request_id)
    assert row.status == "cancelled"
    assert 1 <= row.completion_tokens < 400 and row.prompt_tokens > 0


def test_a_prompt_past_the_context_by_megabytes_holds_up_no_other_request(
    server: Server,
) -> None:
    """Issue 46: while a 7.8 MB prompt was counted as ~2M queued tokens (and its worker
    tokenized it for seconds), 11 of 11 other requests got 429 overloaded with a Retry-After
    of hours; then the big one got its 400. Now its bytes refuse it before admission."""
    capacity = f"{server.url}/v1/deployments/smollm2/capacity"

    def measured() -> bool:  # admission in tokens needs the replica's measured rates
        _chat(server, "Warm up with a few words.", max_tokens=4)
        return httpx.get(capacity).json()["measured_replicas"] > 0

    server.wait_for("a measured replica", measured, 60)
    big: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: big.append(_chat(server, "x" * 7_800_000)))
    thread.start()
    deadline = time.monotonic() + 5  # until it is admitted (and counted), or answered
    while thread.is_alive() and time.monotonic() < deadline:
        if any(r["queued_prompt_tokens"] for r in httpx.get(capacity).json()["replicas"]):
            break
        time.sleep(0.02)
    normal = [_chat(server, f"Say {i}.", max_tokens=2) for i in range(6)]
    thread.join(120)
    assert [r.status_code for r in normal] == [200] * 6, [r.text for r in normal]
    [r] = big
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"


def test_bad_requests_get_openai_errors_and_no_worker_time(server: Server) -> None:
    refused = []
    r = _chat(server, "hi", max_tokens=100_000)
    refused.append(r.headers["x-request-id"])
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    # OpenAI's code and param, which clients (and the openai SDK's users) branch on
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "smollm2", "prompt": "word " * 9000, "max_tokens": 1},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    refused.append(r.headers["x-request-id"])
    # Like every other 400, a request past the context is no request in the ledger: the
    # next good one's row is written after theirs would have been.
    ok = _chat(server, "Say hi.", max_tokens=2)
    server.ledger_row(ok.headers["x-request-id"])
    assert not set(refused) & server.ledger_ids()
    r = httpx.post(
        server.url + CHAT, json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def _replicas(server: Server, name: str) -> list[dict[str, object]]:
    return httpx.get(f"{server.url}/v1/deployments/{name}").json()["replicas"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_idle_deployment_scales_to_zero_and_the_next_request_cold_starts(server: Server) -> None:
    spec = {"name": "idle", "snapshot_uri": server.snapshot_uri, "idle_timeout_s": 2}
    r = httpx.post(f"{server.url}/v1/deployments", json=spec)
    assert r.status_code == 201, r.text
    assert _replicas(server, "idle") == []  # nothing held before the first request

    body = {"model": "idle", "prompt": "One, two,", "max_tokens": 3}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=300).status_code == 200
    (replica,) = _replicas(server, "idle")
    pid = int(replica["pid"])  # type: ignore[arg-type]
    assert replica["state"] == "ready" and _alive(pid)
    phases = replica["cold_start_phases"]
    assert set(phases) == {"queue", "start", "fetch", "load", "warmup"}  # type: ignore[arg-type]
    assert replica["weights_tier"] in ("remote", "disk")
    metrics = httpx.get(f"{server.url}/metrics").text
    for phase in (*phases, "total"):  # type: ignore[union-attr]
        assert f'hotpool_cold_start_seconds_count{{deployment="idle",phase="{phase}"}}' in metrics

    deadline = time.monotonic() + 30
    while _replicas(server, "idle") or _alive(pid):
        assert time.monotonic() < deadline, "the idle worker was not released"
        time.sleep(0.25)

    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    (again,) = _replicas(server, "idle")
    assert again["pid"] != pid and again["snapshot_cache_hit"] is True
    assert server.ledger_row(r.headers["x-request-id"]).cold_start is True
    assert os.path.exists(server.home / "logs")


def test_cli_deploy_invoke_and_usage_against_the_server(server: Server) -> None:
    def hotpool(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HOTPOOL_HOME": str(server.home)}
        cmd = [sys.executable, "-m", "hotpool", *args, "--url", server.url]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    out = hotpool("deploy", "cli-demo", "--snapshot", server.snapshot_uri, "--idle-timeout", "5")
    assert out.returncode == 0 and "deployed cli-demo" in out.stdout, out.stderr
    # Deploying the same snapshot again changes nothing; a new one would roll out a version.
    again = hotpool("deploy", "cli-demo", "--snapshot", server.snapshot_uri)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"cli-demo already serves {server.snapshot_uri} (version 1)"

    out = hotpool("invoke", "smollm2", "What is the capital of France?", "--temperature", "0")
    assert out.returncode == 0 and "Paris" in out.stdout, out.stderr
    assert "prompt +" in out.stderr  # usage goes to stderr, the answer to stdout

    out = hotpool("usage")
    assert out.returncode == 0, out.stderr
    assert any(line.split()[1:2] == ["smollm2"] for line in out.stdout.splitlines()[1:])


def test_concurrent_requests_are_batched_and_each_billed_once(server: Server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> httpx.Response:
        body = {
            "model": "smollm2",
            "prompt": f"Fact number {i}:",
            "max_tokens": 12,
            "temperature": 0,
        }
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(8)))
    assert all(r.status_code == 200 for r in responses)
    ids = {r.headers["x-request-id"] for r in responses}
    assert len(ids) == 8
    for r in responses:
        row = server.ledger_row(r.headers["x-request-id"])
        assert row.completion_tokens == r.json()["usage"]["completion_tokens"] == 12
        assert row.status == "completed"
