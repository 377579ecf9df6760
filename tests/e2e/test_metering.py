"""Every token is counted once, and everywhere the same: what clients were told in `usage`,
what the ledger holds, and what Prometheus counted (a real server and worker)."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_process import Server

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger

pytestmark = pytest.mark.slow


def _call(server: Server, i: int) -> tuple[str, dict[str, int]]:
    """One request (streamed every other time); its ledger key and the usage it reported."""
    body = {"model": "metered", "prompt": f"Count to {i}:", "max_tokens": 3 + i % 5,
            "temperature": 0.7, "seed": i}  # fmt: skip
    if i % 2:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        usage = None
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line.removeprefix("data: ")).get("usage") or usage
        assert usage is not None
        return r.headers["x-hotpool-request-id"], usage
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.headers["x-hotpool-request-id"], r.json()["usage"]


def _counter(text: str, kind: str) -> int:
    match = re.search(
        rf'^hotpool_tokens_total{{deployment="metered",kind="{kind}",version="1"}} (\S+)$',
        text,
        re.M,
    )
    return int(float(match.group(1))) if match else 0


def test_client_usage_ledger_and_prometheus_agree_exactly(server: Server) -> None:
    server.deploy("metered", idle_timeout_s=120)
    with ThreadPoolExecutor(4) as pool:
        calls = list(pool.map(lambda i: _call(server, i), range(24)))
    client_in = sum(u["prompt_tokens"] for _, u in calls)
    client_out = sum(u["completion_tokens"] for _, u in calls)
    assert client_out == sum(3 + i % 5 for i in range(24))

    db = Database(f"sqlite:///{server.home / 'hotpool.db'}")
    try:
        deadline = time.monotonic() + 10
        while True:  # the ledger is written off the request path
            rows = Ledger(db).events("metered", limit=1000)
            if len(rows) >= len(calls) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        db.dispose()
    assert sorted(r.request_id for r in rows) == sorted(rid for rid, _ in calls)  # once each
    assert all(r.status == "completed" for r in rows)
    assert sum(r.prompt_tokens for r in rows) == client_in
    assert sum(r.completion_tokens for r in rows) == client_out

    metrics = httpx.get(f"{server.url}/metrics").text
    assert _counter(metrics, "input") == client_in
    assert _counter(metrics, "output") == client_out
    # The server is shared by the session: leave it with only the deployments it had.
    assert httpx.delete(f"{server.url}/v1/deployments/metered").status_code == 200
