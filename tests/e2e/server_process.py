"""Helpers for e2e tests that drive a real ``hotpool serve`` process."""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

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

    def log(self) -> str:
        return (self.home / "serve.log").read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
