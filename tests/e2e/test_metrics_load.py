"""/metrics of a real server after a load, read with Prometheus' own text parser: its token
counters equal the ledger's totals, the inter-token latency histogram counts every token
after each choice's first, the KV cache gauge comes from the worker's heartbeat, and the
Grafana board queries only series the server has."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from grafana_board import exposed_series, load_board, queried_metrics
from prometheus_client.parser import text_string_to_metric_families
from server_process import Server

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord

pytestmark = pytest.mark.slow

NAME = "metricsload"
MAX_TOKENS = 8
# Long enough for full 16-token KV blocks, so repeats of it hit the prefix cache.
PREFIX = "You are a terse assistant. Answer with one short line and nothing else, please. "


def _body(i: int, stream: bool, n: int = 1) -> dict[str, Any]:
    # ignore_eos: every choice yields exactly MAX_TOKENS tokens, whatever the model says.
    body: dict[str, Any] = {"model": NAME, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                            "temperature": 0.7, "seed": i, "n": n}  # fmt: skip
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _call(server: Server, i: int, stream: bool, chat: bool = False, n: int = 1) -> int:
    """One request; returns the completion tokens its `usage` reported."""
    body = _body(i, stream, n)
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"{PREFIX}Name colour number {i}."}]
    else:
        path = "/v1/completions"
        body["prompt"] = f"{PREFIX}Name colour number {i}."
    if not stream:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["completion_tokens"])
    usage = None
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line.removeprefix("data: ")).get("usage") or usage
    assert usage is not None
    return int(usage["completion_tokens"])


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(server: Server) -> tuple[str, Samples]:
    text = httpx.get(f"{server.url}/metrics").text
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)  # raises on malformed text
        for s in family.samples
    }
    return text, samples


def _value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the series of ``name`` that have ``labels`` (and any others, such as
    the serving ``version``)."""
    want = {("deployment", NAME), *labels.items()}
    return sum(v for (n, have), v in samples.items() if n == name and want <= have)


def _ledger(server: Server, expected: int) -> list[UsageRecord]:
    db = Database(f"sqlite:///{server.home / 'hotpool.db'}")
    try:
        deadline = time.monotonic() + 10
        while True:  # the ledger is written off the request path
            rows = Ledger(db).events(NAME, limit=1000)
            if len(rows) >= expected or time.monotonic() > deadline:
                return rows
            time.sleep(0.1)
    finally:
        db.dispose()


def _kv_usage(server: Server) -> float | None:
    """The deployment's KV gauge, once a heartbeat of its ready worker carried it."""
    deadline = time.monotonic() + 15  # workers beat every 2 s
    while time.monotonic() < deadline:
        _, samples = _scrape(server)
        key = ("hotpool_kv_cache_usage_ratio", frozenset({("deployment", NAME)}))
        if key in samples:
            return samples[key]
        time.sleep(0.5)
    return None


def test_metrics_after_a_load_agree_with_the_ledger(server: Server) -> None:
    server.deploy(NAME, idle_timeout_s=120)
    try:
        # One streamed request first (it pays the cold start): n tokens, n - 1 gaps.
        assert _call(server, 0, stream=True) == MAX_TOKENS
        _, samples = _scrape(server)
        itl = "hotpool_inter_token_latency_seconds"
        assert _value(samples, f"{itl}_count") == MAX_TOKENS - 1
        decode = _value(samples, f"{itl}_sum")
        assert 0 < decode < _value(samples, "hotpool_request_duration_seconds_sum")
        usage = _kv_usage(server)
        assert usage is not None and 0.0 <= usage <= 1.0, usage

        # Then a concurrent mix: completions and chat, streamed and not, two choices, and a
        # repeated prompt (prefix-cache hits are metered as cached input).
        calls: list[tuple[int, bool, bool, int]] = [
            (1, False, False, 1), (2, True, True, 1), (3, False, True, 1),
            (4, True, False, 2), (5, False, False, 2), (1, True, False, 1),
        ]  # fmt: skip
        with ThreadPoolExecutor(4) as pool:
            outputs = list(pool.map(lambda c: _call(server, c[0], c[1], c[2], c[3]), calls))
        assert outputs == [MAX_TOKENS * n for *_, n in calls]
        assert _call(server, 1, stream=False) == MAX_TOKENS  # the same prompt, after the load
        choices = 1 + sum(n for *_, n in calls) + 1
        requests = 1 + len(calls) + 1

        rows = _ledger(server, requests)
        assert len(rows) == requests and all(r.status == "completed" for r in rows)
        text, samples = _scrape(server)
        tokens = {kind: _value(samples, "hotpool_tokens_total", kind=kind)
                  for kind in ("input", "cached_input", "output")}  # fmt: skip
        assert tokens == {
            "input": sum(r.prompt_tokens for r in rows),
            "cached_input": sum(r.cached_tokens for r in rows),
            "output": sum(r.completion_tokens for r in rows),
        }
        assert tokens["cached_input"] > 0  # the repeated prompt hit the prefix cache
        assert _value(samples, "hotpool_requests_total", status="completed") == requests
        for histogram in ("hotpool_time_to_first_token_seconds", "hotpool_request_duration_seconds",
                          "hotpool_queue_seconds"):  # fmt: skip
            assert _value(samples, f"{histogram}_count") == requests, histogram
        # Every token but each choice's first is one inter-token observation.
        assert _value(samples, f"{itl}_count") == tokens["output"] - choices
        assert _value(samples, "hotpool_cold_start_seconds_count", phase="total") >= 1

        missing = queried_metrics(load_board()) - exposed_series(text)
        assert not missing, f"the Grafana board queries series /metrics lacks: {missing}"
    finally:
        # The server is shared by the session: leave it with only the deployments it had.
        assert httpx.delete(f"{server.url}/v1/deployments/{NAME}").status_code == 200
