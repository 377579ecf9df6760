"""Helpers for e2e tests that drive a real ``hotpool serve`` process."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord


@dataclass
class Server:
    url: str
    home: Path
    snapshot_uri: str
    proc: subprocess.Popen[bytes]

    def ledger_row(self, request_id: str, timeout_s: float = 10.0) -> UsageRecord:
        """The ledger row of a request (written off the request path, so poll briefly)."""
        db = Database(f"sqlite:///{self.home / 'hotpool.db'}")
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                rows = [r for r in Ledger(db).events(limit=1000) if r.request_id == request_id]
                if rows:
                    assert len(rows) == 1
                    return rows[0]
                time.sleep(0.1)
        finally:
            db.dispose()
        raise AssertionError(f"no ledger row for {request_id}")

    def ledger_ids(self) -> set[str]:
        """The request ids the ledger holds (the last thousand)."""
        db = Database(f"sqlite:///{self.home / 'hotpool.db'}")
        try:
            return {r.request_id for r in Ledger(db).events(limit=1000)}
        finally:
            db.dispose()

    def log(self) -> str:
        return (self.home / "serve.log").read_text(errors="replace")

    def deploy(self, name: str, **scaling: object) -> None:
        """Create deployment ``name`` of this server's snapshot (if it does not exist)."""
        if httpx.get(f"{self.url}/v1/deployments/{name}").status_code == 404:
            spec = {"name": name, "snapshot_uri": self.snapshot_uri, **scaling}
            r = httpx.post(f"{self.url}/v1/deployments", json=spec)
            assert r.status_code == 201, r.text

    def queued(self, name: str) -> int:
        """Requests of ``name`` waiting for a replica."""
        r = httpx.get(f"{self.url}/v1/deployments/{name}")
        assert r.status_code == 200, r.text
        return int(r.json()["queued_requests"])

    def replicas(self, name: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/v1/deployments/{name}")
        assert r.status_code == 200, r.text
        return r.json()["replicas"]  # type: ignore[no-any-return]

    def scale_events(self, name: str) -> list[dict[str, Any]]:
        """Every scale event of ``name``, oldest first."""
        r = httpx.get(f"{self.url}/v1/deployments/{name}/events", params={"limit": 1000})
        assert r.status_code == 200, r.text
        return list(reversed(r.json()["data"]))

    def wait_for(self, what: str, check: Callable[[], bool], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)


def worker_pids(home: Path) -> list[int]:
    """Live worker processes whose cache dir is under ``home``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            status = (proc / "status").read_text()
        except (OSError, ValueError):
            continue
        if "worker\0" in cmdline and str(home) in cmdline and "\nState:\tZ" not in status:
            pids.append(int(proc.name))
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_server(
    home: Path, snapshot_uri: str, env: dict[str, str], *deploy: str
) -> Iterator[Server]:
    """``hotpool serve`` on a free port with ``HOTPOOL_HOME=home`` and ``env`` on top of the
    CPU defaults; ``deploy``: ``name=uri`` arguments. Stopped (SIGTERM) on exit."""
    port = free_port()
    full_env = {
        **os.environ,
        "HOTPOOL_HOME": str(home),
        "HOTPOOL_PORT": str(port),
        "HOTPOOL_DEVICE": "cpu",
        **env,
    }
    args = [a for spec in deploy for a in ("--deploy", spec)]
    with open(home / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hotpool", "serve", *args],
            env=full_env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    srv = Server(f"http://127.0.0.1:{port}", home, snapshot_uri, proc)
    try:
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
    finally:
        proc.terminate()
        proc.wait(timeout=60)
