"""The warm pool end to end: a real server with ``HOTPOOL_WARM_WORKERS=1``, real workers."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import Server, running_server, worker_pids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def warm_server(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("hotpool-warm")
    env = {"HOTPOOL_MAX_WORKERS": "2", "HOTPOOL_WARM_WORKERS": "1"}
    with running_server(home, f"file://{smollm2_snapshot_bf16}", env) as srv:
        yield srv
    assert _workers_of(home) == [], "shutdown left worker processes behind"


def _workers_of(home: Path) -> list[int]:
    return worker_pids(home)


def _gauge(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def _wait_for_one_idle_worker_only(server: Server, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not (
        _gauge(server, "hotpool_idle_workers") == 1 and _gauge(server, "hotpool_workers") == 1
    ):
        assert time.monotonic() < deadline, "the pool never settled on one idle worker"
        time.sleep(0.25)


def _deploy_and_call(server: Server, name: str) -> dict[str, object]:
    spec = {"name": name, "snapshot_uri": server.snapshot_uri, "idle_timeout_s": 2}
    if httpx.get(f"{server.url}/v1/deployments/{name}").status_code == 404:
        r = httpx.post(f"{server.url}/v1/deployments", json=spec)
        assert r.status_code == 201, r.text
    body = {"model": name, "prompt": "One, two,", "max_tokens": 3}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    (replica,) = httpx.get(f"{server.url}/v1/deployments/{name}").json()["replicas"]
    return replica  # type: ignore[no-any-return]


def _wait_scaled_to_zero(server: Server, name: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{server.url}/v1/deployments/{name}").json()["replicas"]:
        assert time.monotonic() < deadline, f"{name} did not scale to zero"
        time.sleep(0.25)


def test_first_request_claims_the_warm_worker_instead_of_starting_a_process(
    warm_server: Server,
) -> None:
    _wait_for_one_idle_worker_only(warm_server)
    (idle_pid,) = _workers_of(warm_server.home)
    replica = _deploy_and_call(warm_server, "warm-first")
    assert replica["pid"] == idle_pid
    phases = replica["cold_start_phases"]
    assert isinstance(phases, dict)
    assert phases["start"] < 0.5  # a process start takes seconds (torch import, registration)
    assert replica["weights_tier"] in ("remote", "disk")  # a fresh worker: nothing in RAM


def test_scaled_to_zero_deployment_comes_back_from_ram_on_the_same_worker(
    warm_server: Server,
) -> None:
    _wait_for_one_idle_worker_only(warm_server)  # after the previous test's scale-to-zero
    first = _deploy_and_call(warm_server, "warm-again")
    pid = first["pid"]
    _wait_scaled_to_zero(warm_server, "warm-again")

    _wait_for_one_idle_worker_only(warm_server)
    deadline = time.monotonic() + 15  # a surplus warm worker may still be exiting
    while _workers_of(warm_server.home) != [pid]:  # the worker outlived its replica, idle
        assert time.monotonic() < deadline, (_workers_of(warm_server.home), pid)
        time.sleep(0.25)

    again = _deploy_and_call(warm_server, "warm-again")
    assert again["pid"] == pid
    assert again["weights_tier"] == "host"  # the unloaded model stayed in the worker's RAM
    phases = again["cold_start_phases"]
    assert isinstance(phases, dict) and phases["start"] < 0.5
