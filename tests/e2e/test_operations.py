"""Operating a live server: roll a deployment over mid-stream, stop the server mid-stream,
and require API keys, with real ``hotpool serve`` and worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_process import Server, running_server

pytestmark = pytest.mark.slow


def _stream(server: Server, model: str, max_tokens: int, on_chunk: Any = None) -> dict[str, Any]:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    out: dict[str, Any] = {"chunks": 0, "finish": None, "error": None, "done": False}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
        out["status"], out["request_id"] = r.status_code, r.headers["x-request-id"]
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    out["error"] = chunk["error"]
                    continue
                out["chunks"] += 1
                out["finish"] = chunk["choices"][0]["finish_reason"] or out["finish"]
                if on_chunk is not None:
                    on_chunk(out["chunks"])
    return out


def test_patch_rolls_replicas_over_without_dropping_a_stream(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    env = {"HOTPOOL_MAX_WORKERS": "2", "HOTPOOL_WARM_WORKERS": "0"}
    with running_server(tmp_path, f"file://{smollm2_snapshot_bf16}", env) as srv:
        srv.deploy("roll", idle_timeout_s=120)
        patched: dict[str, Any] = {}

        def patch_at(n: int) -> None:
            if n == 3:
                r = httpx.patch(f"{srv.url}/v1/deployments/roll", json={"dtype": "fp32"})
                patched.update(r.json(), status=r.status_code)

        got = _stream(srv, "roll", 120, on_chunk=patch_at)
        assert patched["status"] == 200 and patched["generation"] == 2
        # The stream that was running on the old replica finished as if nothing happened.
        assert got["error"] is None and got["done"] and got["finish"] == "length"
        assert srv.ledger_row(got["request_id"]).completion_tokens == 120

        def only_new() -> bool:
            reps = srv.replicas("roll")
            return len(reps) == 1 and reps[0]["generation"] == 2 and reps[0]["state"] == "ready"

        srv.wait_for("the old generation to drain", only_new, 90)
        body = {"model": "roll", "prompt": "One, two,", "max_tokens": 3}
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).status_code == 200
        reasons = [e["reason"] for e in srv.scale_events("roll")]
        assert "rolling over to version 2" in reasons
        assert "rolled over to version 2" in reasons


HEARTBEAT_TIMEOUT_S = 4.0  # the workers beat every 2 s: one late beat is not a death


def test_sigterm_lets_running_streams_finish_and_bills_them(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    """The stream outlives the heartbeat timeout after the signal: uvicorn has closed the
    listener the heartbeats go to, and the worker must not be taken for dead. A request
    waiting for a worker gets a 503 at once instead of the whole drain's wait."""
    env = {
        "HOTPOOL_MAX_WORKERS": "1",
        "HOTPOOL_WARM_WORKERS": "0",
        "HOTPOOL_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
    }
    with running_server(tmp_path, f"file://{smollm2_snapshot_bf16}", env) as srv:
        srv.deploy("drain", idle_timeout_s=120)
        srv.deploy("cold", idle_timeout_s=120, queue_timeout_s=120)  # no worker free for it
        stopped: dict[str, float] = {}
        waiting: list[httpx.Response] = []

        def wait_for_a_worker() -> None:
            body = {"model": "cold", "prompt": "Hi", "max_tokens": 2}
            waiting.append(httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120))

        queued = threading.Thread(target=wait_for_a_worker)

        def stop_at(n: int) -> None:
            if n == 3:
                queued.start()
                srv.wait_for("the request to queue", lambda: srv.queued("cold") == 1, 30)
                srv.proc.terminate()
                stopped["at"] = time.monotonic()

        # ~10 s of tokens at this machine's warm pace (the cold start out of the timing: with
        # it, a fast machine's stream was sized to ~1 s, over before the signal mattered),
        # well past the heartbeat timeout and the wait for the queued request before the
        # signal, well inside the 30 s drain (a rate that halves or doubles still fits).
        assert _stream(srv, "drain", 2)["finish"] == "length"
        t0 = time.monotonic()
        assert _stream(srv, "drain", 48)["finish"] == "length"
        per_token = (time.monotonic() - t0) / 48
        n = min(max(int(10 / per_token), 48), 4000)
        got = _stream(srv, "drain", n, on_chunk=stop_at)
        streamed_on = time.monotonic() - stopped["at"]
        assert got["error"] is None and got["done"] and got["finish"] == "length"
        assert streamed_on > HEARTBEAT_TIMEOUT_S + 1.5  # else this test proves nothing
        queued.join(30)
        [r] = waiting
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert r.elapsed.total_seconds() < 25  # at once, not after the drain
        # uvicorn exits by re-raising the SIGTERM it handled, so supervisors see it.
        assert srv.proc.wait(timeout=60) in (0, -15)
        # Stopped: no new connections.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{srv.url}/healthz", timeout=2)
        row = srv.ledger_row(got["request_id"])  # flushed before the process exited
        assert row.status == "completed" and row.completion_tokens == n


def _cli(home: Path, *args: str) -> str:
    env = {**os.environ, "HOTPOOL_HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-m", "hotpool", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


SECRET = "my locker code is 7-Zebra-42"  # a prompt no log line may hold


def test_keys_required_the_openai_client_works_with_one(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    created = _cli(tmp_path, "tenants", "create", "acme")  # "created tenant acme (id N)"
    tenant_id = int(created.rpartition("id ")[2].rstrip(")"))
    key = _cli(tmp_path, "keys", "create", "--tenant", "acme", "--scopes", "deploy,invoke")
    env = {
        "HOTPOOL_MAX_WORKERS": "1", "HOTPOOL_WARM_WORKERS": "0", "HOTPOOL_AUTH": "keys",
        "HOTPOOL_LOG_FORMAT": "json", "HOTPOOL_LOG_LEVEL": "debug",  # no prompt even so
    }  # fmt: skip
    with running_server(tmp_path, f"file://{smollm2_snapshot_bf16}", env) as srv:
        assert "x-hotpool-auth" not in httpx.get(f"{srv.url}/healthz").headers
        spec = {"name": "secure", "snapshot_uri": srv.snapshot_uri}
        headers = {"authorization": f"Bearer {key}"}
        assert httpx.post(f"{srv.url}/v1/deployments", json=spec).status_code == 401
        r = httpx.post(f"{srv.url}/v1/deployments", json=spec, headers=headers)
        assert r.status_code == 201, r.text

        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="secure", messages=[{"role": "user", "content": SECRET}], max_tokens=3
        )
        out = raw.parse()
        assert out.usage is not None and out.usage.completion_tokens == 3
        request_id = raw.headers["x-hotpool-request-id"]
        stranger = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="hp_" + "0" * 40, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()

        _cli(tmp_path, "keys", "revoke", key[:11])
        deadline = time.monotonic() + 5
        while True:  # the CLI wrote to the database the server reads on every request
            try:
                client.models.list()
            except openai.AuthenticationError:
                break
            assert time.monotonic() < deadline, "a revoked key still works"
            time.sleep(0.1)

        # The request's line in the structured log: who, what, how many tokens, how long.
        line = _log_line(srv, "hotpool.requests", request_id)
        assert line["level"] == "info" and line["ts"].endswith("+00:00")
        assert (line["tenant_id"], line["api_key"], line["deployment"]) == (
            tenant_id,
            key[:11],
            "secure",
        )
        assert (line["endpoint"], line["status"], line["error"]) == (
            "chat.completions",
            "completed",
            None,
        )
        assert (line["prompt_tokens"], line["completion_tokens"]) == (out.usage.prompt_tokens, 3)
        assert 0 < line["ttft_seconds"] <= line["total_seconds"]
        access = _log_line(srv, "hotpool.access", request_id)
        assert (access["path"], access["status"]) == ("/v1/chat/completions", 200)
    # Every line of the control plane's log and of the worker's is one JSON object (the
    # worker's name its worker), and none holds the key or the prompt.
    workers = [p.read_text() for p in (tmp_path / "logs").glob("w-*.log")]
    assert len(workers) == 1
    lines = [json.loads(text) for log in (srv.log(), *workers) for text in log.splitlines()]
    assert all(line["logger"] and line["level"] for line in lines)
    mine = [line for line in lines if line.get("worker_id")]
    assert any(line["logger"] == "hotpool.worker" for line in mine)
    assert any(line["logger"].startswith("uvicorn") for line in mine)
    for text in (srv.log(), *workers):
        assert key[11:] not in text and SECRET not in text


def test_prompts_are_logged_only_at_debug_level_when_asked(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    env = {
        "HOTPOOL_MAX_WORKERS": "1", "HOTPOOL_WARM_WORKERS": "0", "HOTPOOL_LOG_FORMAT": "json",
        "HOTPOOL_LOG_LEVEL": "debug", "HOTPOOL_LOG_PROMPTS": "20",
    }  # fmt: skip
    with running_server(tmp_path, f"file://{smollm2_snapshot_bf16}", env) as srv:
        srv.deploy("talk", idle_timeout_s=120)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.with_raw_response.create(
            model="talk", messages=[{"role": "user", "content": SECRET}], max_tokens=4,
            temperature=0,
        )  # fmt: skip
        text = client.completions.with_raw_response.create(
            model="talk", prompt="Once upon a time", max_tokens=3, n=2, temperature=0
        )
        said = _log_line(srv, "hotpool.requests", chat.headers["x-hotpool-request-id"], "debug")
        assert said["messages"] == [
            {"role": "user", "content": SECRET[:20] + f"... [{len(SECRET) - 20} more characters]"}
        ]
        assert said["prompt"] is None
        assert said["output"] == [_cut(chat.parse().choices[0].message.content or "", 20)]
        said = _log_line(srv, "hotpool.requests", text.headers["x-hotpool-request-id"], "debug")
        assert (said["prompt"], said["messages"]) == ("Once upon a time", None)
        assert said["output"] == [_cut(c.text, 20) for c in text.parse().choices]
    warnings = [json.loads(t) for t in srv.log().splitlines() if "HOTPOOL_LOG_PROMPTS" in t]
    assert warnings[0]["level"] == "warning" and "PROMPTS ARE LOGGED" in warnings[0]["message"]


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


def _log_line(srv: Server, logger: str, request_id: str, level: str = "info") -> dict[str, Any]:
    """The JSON log line of ``logger`` at ``level`` about ``request_id`` (written once the
    request is over, so waited for)."""
    deadline = time.monotonic() + 10
    while True:
        for text in srv.log().splitlines():
            if request_id in text:
                line = json.loads(text)
                if (line["logger"], line["level"], line.get("request_id")) == (
                    logger, level, request_id
                ):  # fmt: skip
                    return line  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"no {level} line of {logger} for {request_id}"
        time.sleep(0.1)


def test_concurrent_sigterm_does_not_lose_queued_requests(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    """Requests already accepted when the server is told to stop still get an answer."""
    env = {"HOTPOOL_MAX_WORKERS": "1", "HOTPOOL_WARM_WORKERS": "0"}
    with running_server(tmp_path, f"file://{smollm2_snapshot_bf16}", env) as srv:
        srv.deploy("busy", idle_timeout_s=120)
        results: list[dict[str, Any]] = []
        threads = [
            threading.Thread(target=lambda: results.append(_stream(srv, "busy", 24)))
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        srv.wait_for("all three in flight", lambda: _inflight(srv, "busy") == 3, 120)
        srv.proc.terminate()
        for t in threads:
            t.join()
        assert [r["finish"] for r in results] == ["length"] * 3
        assert srv.proc.wait(timeout=60) in (0, -15)


def _inflight(srv: Server, name: str) -> int:
    return sum(r["inflight"] for r in srv.replicas(name))
