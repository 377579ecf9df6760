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


def test_sigterm_lets_running_streams_finish_and_bills_them(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    env = {"HOTPOOL_MAX_WORKERS": "1", "HOTPOOL_WARM_WORKERS": "0"}
    with running_server(tmp_path, f"file://{smollm2_snapshot_bf16}", env) as srv:
        srv.deploy("drain", idle_timeout_s=120)

        def stop_at(n: int) -> None:
            if n == 3:
                srv.proc.terminate()

        got = _stream(srv, "drain", 60, on_chunk=stop_at)
        assert got["error"] is None and got["done"] and got["finish"] == "length"
        # uvicorn exits by re-raising the SIGTERM it handled, so supervisors see it.
        assert srv.proc.wait(timeout=60) in (0, -15)
        # Stopped: no new connections.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{srv.url}/healthz", timeout=2)
        row = srv.ledger_row(got["request_id"])  # flushed before the process exited
        assert row.status == "completed" and row.completion_tokens == 60


def _cli(home: Path, *args: str) -> str:
    env = {**os.environ, "HOTPOOL_HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-m", "hotpool", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_keys_required_the_openai_client_works_with_one(
    tmp_path: Path, smollm2_snapshot_bf16: Path
) -> None:
    _cli(tmp_path, "tenants", "create", "acme")
    key = _cli(tmp_path, "keys", "create", "--tenant", "acme", "--scopes", "deploy,invoke")
    env = {"HOTPOOL_MAX_WORKERS": "1", "HOTPOOL_WARM_WORKERS": "0", "HOTPOOL_AUTH": "keys"}
    with running_server(tmp_path, f"file://{smollm2_snapshot_bf16}", env) as srv:
        assert "x-hotpool-auth" not in httpx.get(f"{srv.url}/healthz").headers
        spec = {"name": "secure", "snapshot_uri": srv.snapshot_uri}
        headers = {"authorization": f"Bearer {key}"}
        assert httpx.post(f"{srv.url}/v1/deployments", json=spec).status_code == 401
        r = httpx.post(f"{srv.url}/v1/deployments", json=spec, headers=headers)
        assert r.status_code == 201, r.text

        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
        out = client.chat.completions.create(
            model="secure", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert out.usage is not None and out.usage.completion_tokens == 3
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
