"""The Ray backend end to end: a two-node Ray cluster started here, a real ``hotpool serve``
with ``HOTPOOL_BACKEND=ray`` on it, real SmolLM2 workers as Ray actors.

Both nodes run on this machine (each its own raylet, resources and temp dir) with one CPU
each, so two workers that each hold a CPU must land on different nodes. The test talks to
Ray only through short driver subprocesses: pytest itself never imports ``ray``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import Server, free_port, running_server, worker_pids

pytestmark = [
    pytest.mark.slow,
    # An optional extra (`pip install 'hotpool[ray]'`); looked up, not imported, here.
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
]

RAY = str(Path(sys.executable).parent / "ray")
IDLE_S = 120  # long enough to inspect and kill a worker before its deployment scales down

# Runs as `python -c DRIVER ADDRESS COMMAND [WORKER_ID...]`, prints one JSON value.
DRIVER = """
import json, sys, time
import ray
address, command, ids = sys.argv[1], sys.argv[2], sys.argv[3:]
ray.init(address=address, namespace="hotpool", log_to_driver=False, logging_level="ERROR")
if command == "nodes":  # wait until both nodes joined
    deadline = time.monotonic() + 60
    while sum(n["Alive"] for n in ray.nodes()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    out = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
elif command == "where":
    actors = [ray.get_actor("hotpool-worker-" + i, namespace="hotpool") for i in ids]
    out = ray.get([a.where.remote() for a in actors], timeout=30)
elif command == "kill":
    ray.kill(ray.get_actor("hotpool-worker-" + ids[0], namespace="hotpool"))
    out = ids[0]
elif command == "actors":
    out = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
           if a["namespace"] == "hotpool"]
print(json.dumps(out))
"""


def driver(address: str, command: str, *ids: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, address, command, *ids],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ray_start(args: list[str], temp_dir: Path) -> subprocess.Popen[bytes]:
    """One Ray node as its own process group (``--block``: it lives as long as this
    process), so the test stops exactly the processes it started, never another cluster."""
    ports = [f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
    cmd = [RAY, "start", "--block", "--num-cpus=1", "--object-store-memory=100000000",
           "--disable-usage-stats", f"--temp-dir={temp_dir}", *ports, *args]  # fmt: skip
    temp_dir.mkdir(parents=True, exist_ok=True)
    with open(temp_dir / "ray-start.log", "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _ray_stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to ``ray start`` alone drains the node and stops its processes (a signal to
    the whole group makes it hang); SIGKILL to the group for whatever is left after that."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=40)  # Ray drains for up to 30 s
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the head's GCS accepts connections (a node or driver started before gives up)."""
    deadline = time.monotonic() + 90
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        assert proc.poll() is None, f"the Ray head exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the Ray head did not start"
        time.sleep(0.2)


def _start_nodes(root: Path, port: int, nodes: list[subprocess.Popen[bytes]]) -> None:
    head_args = ["--head", f"--port={port}", "--include-dashboard=false",
                 f"--dashboard-port={free_port()}"]  # fmt: skip
    if importlib.util.find_spec("grpc"):  # ray[client]: its server would take port 10001
        head_args.append(f"--ray-client-server-port={free_port()}")
    nodes.append(_ray_start(head_args, root / "head"))
    _wait_listening(port, nodes[0], root / "head" / "ray-start.log")
    address = f"127.0.0.1:{port}"
    nodes.append(_ray_start([f"--address={address}", '--resources={"node2": 1}'], root / "node2"))
    assert len(driver(address, "nodes")) == 2, "the second Ray node never joined"


@contextlib.contextmanager
def ray_cluster() -> Iterator[str]:
    """A head and a second node (with resource ``node2``); yields the head's address."""
    # A short path of our own: Ray's unix sockets live under it (the path limit is ~107).
    root = Path(tempfile.mkdtemp(prefix="hpray", dir="/tmp"))
    port = free_port()
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        try:
            _start_nodes(root, port, nodes)
        except BaseException:
            for log in sorted(root.glob("*/ray-start.log")):  # shown with the failure
                print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")
            raise
        yield f"127.0.0.1:{port}"
    finally:
        for proc in reversed(nodes):
            _ray_stop(proc)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    with ray_cluster() as address:
        yield address


@pytest.fixture(scope="module")
def ray_server(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path, ray_address: str
) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("hotpool-ray")
    env = {
        "HOTPOOL_BACKEND": "ray",
        "HOTPOOL_RAY_ADDRESS": ray_address,
        "HOTPOOL_MAX_WORKERS": "2",
        "HOTPOOL_WARM_WORKERS": "0",  # a worker lives exactly as long as its replica
        "HOTPOOL_SCALE_DOWN_WINDOW_S": "1",
        "HOTPOOL_KV_CACHE_BYTES": "64m",  # forwarded to the workers: two fit in little RAM
    }
    with running_server(home, f"file://{smollm2_snapshot_bf16}", env) as srv:
        yield srv
    assert driver(ray_address, "actors") == [], "shutdown left Ray actors behind"
    srv.wait_for("worker processes to exit", lambda: worker_pids(home) == [], 15)


def complete(server: Server, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": "One, two,", "max_tokens": 3}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    return r.json()  # type: ignore[no-any-return]


def worker_of(server: Server, name: str) -> str:
    (replica,) = server.replicas(name)
    return str(replica["worker_id"])


def test_workers_on_two_nodes_serve_survive_an_actor_kill_and_scale_to_zero(
    ray_server: Server, ray_address: str
) -> None:
    for name in ("ray-a", "ray-b"):
        ray_server.deploy(name, idle_timeout_s=IDLE_S)
    with ThreadPoolExecutor(2) as pool:  # two cold starts at once: two actors, one per node
        list(pool.map(lambda name: complete(ray_server, name), ("ray-a", "ray-b")))
    a, b = worker_of(ray_server, "ray-a"), worker_of(ray_server, "ray-b")
    where = driver(ray_address, "where", a, b)
    assert where[0]["node_id"] != where[1]["node_id"], where

    driver(ray_address, "kill", a)
    # Noticed through Ray (the actor's ObjectRef fails), not after a heartbeat timeout.
    ray_server.wait_for(
        "the killed actor to be noticed",
        lambda: any("Ray actor" in (e["reason"] or "") for e in ray_server.scale_events("ray-a")),
        timeout_s=30,  # the reason tells Ray's notice from a heartbeat's; a loaded machine is slow
    )
    complete(ray_server, "ray-a")
    assert worker_of(ray_server, "ray-a") != a  # served by a replacement worker

    for name in ("ray-a", "ray-b"):  # now idle: a short timeout (no new version) ends them
        r = httpx.patch(f"{ray_server.url}/v1/deployments/{name}", json={"idle_timeout_s": 1})
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
    for name in ("ray-a", "ray-b"):
        ray_server.wait_for(f"{name} to scale to zero", lambda n=name: not ray_server.replicas(n))
    ray_server.wait_for("the Ray actors to go", lambda: driver(ray_address, "actors") == [])
