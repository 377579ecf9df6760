"""Deployment versions end to end: a canary's traffic split, stickiness per user, usage per
version, rollback and promote under load, against a real ``hotpool serve`` with SmolLM2.

Version 1 is the snapshot as deployed; version 2 is the same snapshot with another
``max_model_len``: a different thing for replicas to run, so a version of its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import Server, running_server

pytestmark = pytest.mark.slow

NAME = "cn"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("canary-home")
    uri = f"file://{smollm2_snapshot_bf16}"
    env = {"HOTPOOL_MAX_WORKERS": "2", "HOTPOOL_WARM_WORKERS": "0"}
    with running_server(home, uri, env) as server:
        server.deploy(NAME, max_replicas=1, idle_timeout_s=600)
        yield server


@dataclass
class Reply:
    version: int
    prompt_tokens: int
    completion_tokens: int


async def _complete(client: httpx.AsyncClient, user: str | None = None) -> Reply:
    body: dict[str, Any] = {"model": NAME, "prompt": "Hello", "max_tokens": 1}
    if user is not None:
        body["user"] = user
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return Reply(int(r.headers["x-hotpool-version"]), usage["prompt_tokens"],
                 usage["completion_tokens"])  # fmt: skip


async def _many(url: str, users: list[str | None], concurrency: int = 16) -> list[Reply]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(user: str | None) -> Reply:
            async with limit:
                return await _complete(client, user)

        return await asyncio.gather(*(one(u) for u in users))


def _binomial_p_value(k: int, n: int, p: float) -> float:
    """Two-sided exact binomial test (twice the smaller tail, at most 1)."""
    pmf = [math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(n + 1)]
    return min(1.0, 2 * min(sum(pmf[: k + 1]), sum(pmf[k:])))


def _patch(srv: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.patch(f"{srv.url}/v1/deployments/{NAME}", json=body, timeout=30)


def _set_canary(srv: Server, version: int, percent: float) -> None:
    r = _patch(srv, {"canary": {"version": version, "percent": percent}})
    assert r.status_code == 200, r.text


def _versions_running(srv: Server) -> set[int]:
    return {r["version"] for r in srv.replicas(NAME)}


def test_a_canary_gets_its_share_sticky_per_user_and_billed_per_version(srv: Server) -> None:
    replies = asyncio.run(_many(srv.url, [None]))  # the stable version, warm
    r = _patch(srv, {"max_model_len": 512, "canary": {"percent": 20}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["version"], body["canary"]) == (1, {"version": 2, "percent": 20.0})
    versions = httpx.get(f"{srv.url}/v1/deployments/{NAME}/versions").json()["data"]
    assert [(v["version"], v["role"], v["traffic_percent"]) for v in versions] == [
        (1, "stable", 80.0), (2, "canary", 20.0)
    ]  # fmt: skip
    assert versions[1]["changes"] == {"max_model_len": [None, 512]}
    assert versions[1]["created_by"] == "local"

    split = asyncio.run(_many(srv.url, [None] * 500))
    canary = sum(1 for x in split if x.version == 2)
    assert {x.version for x in split} == {1, 2}
    assert _binomial_p_value(canary, 500, 0.2) > 0.001, canary

    users = [f"user-{i}" for i in range(30)]
    sticky = asyncio.run(_many(srv.url, [u for u in users for _ in range(3)]))
    by_user: dict[str, set[int]] = {}
    for user, reply in zip([u for u in users for _ in range(3)], sticky, strict=True):
        by_user.setdefault(user, set()).add(reply.version)
    assert all(len(v) == 1 for v in by_user.values()), by_user
    assert {v for vs in by_user.values() for v in vs} == {1, 2}  # both sides have users

    # The ledger and /v1/usage report each version's requests and tokens exactly.
    sent = replies + split + sticky
    want = Counter()
    for x in sent:
        want[(x.version, "requests")] += 1
        want[(x.version, "input")] += x.prompt_tokens
        want[(x.version, "output")] += x.completion_tokens

    def billed() -> Counter[tuple[int, str]]:
        page = httpx.get(
            f"{srv.url}/v1/usage",
            params={"group_by": "version", "models": NAME, "bucket_width": "1d", "limit": 2},
        ).json()
        got: Counter[tuple[int, str]] = Counter()
        for bucket in page["data"]:
            for res in bucket["results"]:
                got[(res["version"], "requests")] += res["num_model_requests"]
                got[(res["version"], "input")] += res["input_tokens"]
                got[(res["version"], "output")] += res["output_tokens"]
        return got

    srv.wait_for("the ledger to hold every request", lambda: billed() == want, timeout_s=20)
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert (
        f'hotpool_requests_total{{deployment="{NAME}",status="completed",version="2"}}' in metrics
    )


@pytest.mark.parametrize(
    ("canary", "status", "code"),
    [
        ({"percent": 101}, 400, None),
        ({"percent": -1}, 400, None),
        ({"percent": "5"}, 400, None),
        ({"version": 2}, 400, None),  # no percent
        ({"percent": 5}, 400, None),  # no version and nothing new to make one
        ({"version": 99, "percent": 5}, 404, "version_not_found"),
        ({"version": 1, "percent": 5, "extra": 1}, 400, None),
    ],
)
def test_invalid_splits_are_clear_errors(
    srv: Server, canary: dict[str, Any], status: int, code: str | None
) -> None:
    r = _patch(srv, {"canary": canary})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and (code is None or err["code"] == code), err
    assert err["param"] is None or err["param"].startswith("canary"), err


def test_conflicting_canaries_and_deleted_deployments(srv: Server) -> None:
    stable = httpx.get(f"{srv.url}/v1/deployments/{NAME}").json()["version"]
    r = _patch(srv, {"canary": {"version": stable, "percent": 5}})
    assert r.status_code == 409 and "stable version already" in r.json()["error"]["message"]
    r = _patch(srv, {"dtype": "fp32", "canary": {"version": 1, "percent": 5}})
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"]
    srv.deploy("gone", max_replicas=1)
    assert httpx.delete(f"{srv.url}/v1/deployments/gone").status_code == 200
    r = httpx.patch(f"{srv.url}/v1/deployments/gone", json={"canary": {"version": 1, "percent": 5}})
    assert r.status_code == 404 and r.json()["error"]["code"] == "deployment_not_found"
    for action in ("promote", "rollback"):
        assert httpx.post(f"{srv.url}/v1/deployments/gone/{action}").status_code == 404


async def _streams(url: str, n: int, started: asyncio.Event | None = None) -> list[dict[str, Any]]:
    """``n`` streams of 40 tokens; each result: version, text, finish, errors."""
    first = asyncio.Semaphore(0)

    async def one(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
        body = {"model": NAME, "prompt": f"Story {i}:", "max_tokens": 40, "stream": True,
                "temperature": 0, "user": f"streamer-{i}"}  # fmt: skip
        out: dict[str, Any] = {"text": "", "finish": None, "errors": [], "done": False}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            out["version"] = int(r.headers["x-hotpool-version"])
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["errors"].append(chunk["error"])
                    continue
                if not out["text"] and not out["finish"]:
                    first.release()
                c = chunk["choices"][0]
                out["text"] += c["text"]
                out["finish"] = c["finish_reason"] or out["finish"]
        return out

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(n)]
        for _ in range(n):  # every stream has its first token before the change
            await first.acquire()
        if started is not None:
            started.set()
        return await asyncio.gather(*tasks)


async def _during_streams(srv: Server, action: str, n: int) -> tuple[list[Any], list[Reply]]:
    started = asyncio.Event()
    streams = asyncio.create_task(_streams(srv.url, n, started))
    await started.wait()
    r = await asyncio.to_thread(httpx.post, f"{srv.url}/v1/deployments/{NAME}/{action}")
    assert r.status_code == 200, r.text
    after = await _many(srv.url, [None] * 10 + [f"streamer-{i}" for i in range(n)])
    return await streams, after


def test_rollback_under_load_fails_nothing_and_sends_new_requests_to_stable(srv: Server) -> None:
    _set_canary(srv, 2, 50)
    asyncio.run(_many(srv.url, [f"streamer-{i}" for i in range(8)]))  # both versions warm
    stable = httpx.get(f"{srv.url}/v1/deployments/{NAME}").json()["version"]
    streams, after = asyncio.run(_during_streams(srv, "rollback", 8))
    assert {s["version"] for s in streams} == {1, 2}  # streams on both versions ...
    for s in streams:  # ... all finished where they started
        assert s["done"] and s["finish"] == "length" and not s["errors"], s
    assert {x.version for x in after} == {stable}
    assert httpx.get(f"{srv.url}/v1/deployments/{NAME}").json()["canary"] is None
    srv.wait_for("the canary's replicas to drain", lambda: _versions_running(srv) == {stable})


def test_promote_drains_the_old_version_without_cutting_a_stream(srv: Server) -> None:
    _set_canary(srv, 2, 50)
    asyncio.run(_many(srv.url, [f"streamer-{i}" for i in range(8)]))
    streams, after = asyncio.run(_during_streams(srv, "promote", 8))
    for s in streams:
        assert s["done"] and s["finish"] == "length" and not s["errors"], s
    assert {x.version for x in after} == {2}
    body = httpx.get(f"{srv.url}/v1/deployments/{NAME}").json()
    assert (body["version"], body["previous_version"], body["canary"]) == (2, 1, None)
    srv.wait_for("version 1 to drain to zero", lambda: _versions_running(srv) == {2})
    events = srv.scale_events(NAME)
    assert any(e["reason"] == "rolled over to version 2" for e in events)


def _cli(srv: Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOTPOOL_HOME": str(srv.home)}
    return subprocess.run(
        [sys.executable, "-m", "hotpool", *args, "--url", srv.url],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_cli_starts_lists_and_ends_a_canary(srv: Server, tmp_path: Path) -> None:
    stable = httpx.get(f"{srv.url}/v1/deployments/{NAME}").json()
    same = _cli(srv, "deploy", NAME, "--snapshot", stable["snapshot_uri"], "--canary", "5")
    assert same.returncode == 1
    assert "409: the canary would run what the stable version runs" in same.stderr
    # Another URI for the same files (a link) is another snapshot, so a new version.
    link = tmp_path / "smollm2-again"
    link.symlink_to(stable["snapshot_uri"].removeprefix("file://"))
    out = _cli(srv, "deploy", NAME, "--snapshot", f"file://{link}", "--canary", "5")
    assert out.returncode == 0, out.stderr
    new = httpx.get(f"{srv.url}/v1/deployments/{NAME}").json()["canary"]["version"]
    assert out.stdout.strip() == (
        f"{NAME}: version {stable['version']} is stable; version {new} takes 5% (canary)"
    )
    listed = _cli(srv, "versions", NAME)
    assert listed.returncode == 0, listed.stderr
    canary_row = next(line for line in listed.stdout.splitlines() if line.startswith(str(new)))
    assert "canary" in canary_row and "5%" in canary_row and str(link) in canary_row
    back = _cli(srv, "rollback", NAME)
    assert back.stdout.strip() == f"{NAME}: version {stable['version']} is stable"
    nothing = _cli(srv, "promote", NAME)
    assert nothing.returncode == 1 and "no canary to promote" in nothing.stderr
