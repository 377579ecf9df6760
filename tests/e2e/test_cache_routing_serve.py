"""Cache-aware routing through a live ``hotpool serve`` with two SmolLM2 replicas.

A prompt that shares a long prefix with one in flight goes to the replica computing it,
although the other replica is idle (least-loaded routing would send it there), and its
``cached_tokens`` show it; once that replica is at its target concurrency, the next one goes
to the other replica instead; the router's prefix hashes appear in no API; a replica whose
worker is killed steers nothing (the next request is served, by the survivor).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import Server, running_server, worker_pids

from hotpool.platform.prompt_hasher import _tokenizer_from
from hotpool.worker.prefix_hash import deployment_salt, prompt_block_hashes, reported
from hotpool.worker.prompt import prompt_token_ids
from hotpool.worker.protocol import ChatMessage, GenerateRequest, SamplingParams
from hotpool.worker.tokenizer import TOKENIZER_FILES

pytestmark = pytest.mark.slow

NAME = "routed"
DOC = "Answer from this lease. " + " ".join(
    f"Clause {i}: the tenant pays {i * 3} dollars by day {i} of the month." for i in range(25)
)


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": DOC}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("routing-home")
    uri = f"file://{smollm2_snapshot_bf16}"
    env = {
        "HOTPOOL_MAX_WORKERS": "2",
        "HOTPOOL_WARM_WORKERS": "0",
        "HOTPOOL_HEARTBEAT_TIMEOUT_S": "10",  # several beats: a loaded machine delays them
    }
    with running_server(home, uri, env) as srv:
        srv.deploy(NAME, min_replicas=2, max_replicas=2, target_concurrency=2, idle_timeout_s=600)
        srv.wait_for("two ready replicas", lambda: _ready(srv) == 2, 300)
        # Traffic before the test's (its tokenizer reaches the router once the replicas
        # are ready; a heartbeat follows): the router starts from what it has seen.
        body = {"model": NAME, "prompt": "Hello", "max_tokens": 1}
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=300).status_code == 200
        time.sleep(2.5)
        yield srv


def _ready(srv: Server) -> int:
    reps = httpx.get(f"{srv.url}/v1/deployments/{NAME}", timeout=10).json()["replicas"]
    return sum(r["state"] == "ready" for r in reps)


def _chat(srv: Server, question: str, max_tokens: int = 1) -> dict[str, Any]:
    body = {"model": NAME, "messages": _messages(question), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["usage"]  # type: ignore[no-any-return]


def _cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


class Busy:
    """A long streamed answer about the document, read to the end in the background; the
    replica holding the document's prefix computes it (``started`` once its text flows)."""

    def __init__(self, srv: Server) -> None:
        self.started = threading.Event()
        self.usage: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(srv,), daemon=True)
        self.thread.start()
        assert self.started.wait(120)

    def _run(self, srv: Server) -> None:
        body = {"model": NAME, "messages": _messages("Summarise every clause."),
                "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        self.started.set()
                    self.usage = chunk.get("usage") or self.usage
        self.started.set()

    def join(self) -> dict[str, Any]:
        self.thread.join(300)
        return self.usage


def test_prefix_affinity_within_the_load_limit(server: Server, smollm2_snapshot_bf16: Path) -> None:
    first = _chat(server, "When is clause 3 due?")
    prefix = first["prompt_tokens"] - 16  # the document, whatever the question's tokens
    busy = Busy(server)  # goes where the document is cached, and keeps that replica busy
    # One request in flight there, none on the other replica: the document's replica all
    # the same (it computes only the question), under its target concurrency of 2.
    second = _chat(server, "What does clause 9 cost?")
    assert _cached(second) >= prefix, second
    # Two in flight there: at its target, so the next one goes to the idle replica, which
    # has never seen the document.
    other = Busy(server)
    third = _chat(server, "And clause 12?")
    assert _cached(third) < prefix, third
    for b in (busy, other):
        assert _cached(b.join()) >= prefix

    # The hashes the router holds appear in no API.
    manifest = json.loads((smollm2_snapshot_bf16 / "manifest.json").read_text())
    files = {n: (smollm2_snapshot_bf16 / n).read_text() for n in TOKENIZER_FILES
             if (smollm2_snapshot_bf16 / n).exists()}  # fmt: skip
    tok = _tokenizer_from(files)
    req = GenerateRequest("x", SamplingParams(), messages=tuple(
        ChatMessage(m["role"], m["content"]) for m in _messages("When is clause 3 due?")
    ))  # fmt: skip
    ids = prompt_token_ids(tok, req, None)
    salt = deployment_salt(manifest["digest"], NAME)
    hashes = {reported(h) for h in prompt_block_hashes(ids, 16, salt)}
    assert len(hashes) >= 10
    paths = ["/v1/deployments", f"/v1/deployments/{NAME}", "/metrics", "/v1/usage/summary"]
    shown = " ".join(httpx.get(f"{server.url}{p}", timeout=10).text for p in paths)
    assert not any(h in shown for h in hashes)


def test_a_killed_replica_steers_nothing(server: Server) -> None:
    _chat(server, "When is clause 4 due?")  # the document is cached somewhere
    pids = worker_pids(server.home)
    assert len(pids) == 2
    for pid in pids[:1]:
        os.kill(pid, signal.SIGKILL)
    # Whichever replica died, the next request is served: never sent to the dead one, or
    # retried on the survivor before its first token.
    usage = _chat(server, "When is clause 5 due?")
    assert usage["completion_tokens"] == 1
    server.wait_for("the dead replica replaced", lambda: _ready(server) == 2, 300)


def test_measured_capacity_and_a_plan_from_it(server: Server) -> None:
    for q in ("When is clause 6 due?", "And clause 7?"):
        _chat(server, q, max_tokens=8)  # steps for the engines to measure

    def measured() -> dict[str, Any]:
        r = httpx.get(f"{server.url}/v1/deployments/{NAME}/capacity", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    server.wait_for("a measured curve", lambda: bool(measured()["curve"]), 30)
    cap = measured()
    assert cap["deployment"] == NAME and cap["measured_replicas"] >= 1
    assert all(p["tokens_per_second"] > 0 for p in cap["curve"])
    assert cap["output_tokens_mean"] is not None
    missing = httpx.get(f"{server.url}/v1/deployments/nope/capacity", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "deployment_not_found"
    args = ["plan", "--deployment", NAME, "--rps", "0.2", "--prompt-tokens", "300",
            "--output-tokens", "16", "--ttft-p95", "30", "--url", server.url]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "hotpool", *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    replicas = int(out.stdout.split("replicas: ")[1].split()[0])
    assert replicas >= 1 and "predicted TTFT: p95" in out.stdout and "headroom 30%" in out.stdout
    # A target no replica count can meet: one prompt alone is slower.
    args[args.index("--ttft-p95") + 1] = "0.0001"
    out = subprocess.run([sys.executable, "-m", "hotpool", *args], capture_output=True, text=True)
    assert out.returncode == 1 and "alone takes" in out.stderr
