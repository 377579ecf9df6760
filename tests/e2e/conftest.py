"""A real ``hotpool serve`` process (control plane + local worker processes) for e2e tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import Server, running_server


@pytest.fixture(scope="session")
def server(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[Server]:
    """Without a warm pool: every cold start starts a worker process, every release stops it
    (tests/e2e/test_warm_pool.py runs its own server with one)."""
    home = tmp_path_factory.mktemp("hotpool-home")
    uri = f"file://{smollm2_snapshot_bf16}"
    env = {"HOTPOOL_MAX_WORKERS": "2", "HOTPOOL_WARM_WORKERS": "0"}
    with running_server(home, uri, env, f"smollm2={uri}") as srv:
        yield srv
