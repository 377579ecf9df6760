"""A real ``hotpool serve`` process (control plane + local worker processes) for e2e tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import Server, free_port


@pytest.fixture(scope="session")
def server(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("hotpool-home")
    port = free_port()
    env = {
        **os.environ,
        "HOTPOOL_HOME": str(home),
        "HOTPOOL_PORT": str(port),
        "HOTPOOL_DEVICE": "cpu",
        "HOTPOOL_MAX_WORKERS": "2",
    }
    uri = f"file://{smollm2_snapshot_bf16}"
    with open(home / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hotpool", "serve", "--deploy", f"smollm2={uri}"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    srv = Server(f"http://127.0.0.1:{port}", home, uri, proc)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{srv.url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"hotpool serve did not start:\n{srv.log()}")
        time.sleep(0.2)
    yield srv
    proc.terminate()
    proc.wait(timeout=60)
