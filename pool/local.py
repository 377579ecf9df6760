"""Worker processes on this machine: ``python -m hotpool worker`` per worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hotpool.pool.backend import WorkerBackend, WorkerHandle


@dataclass(frozen=True)
class LocalWorkerConfig:
    control_plane_url: str
    token: str
    cache_dir: Path
    log_dir: Path
    device: str = "auto"
    log_level: str = "info"


class LocalProcessBackend(WorkerBackend):
    def __init__(self, config: LocalWorkerConfig) -> None:
        self.config = config
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    async def start(self, worker_id: str) -> WorkerHandle:
        c = self.config
        c.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = c.log_dir / f"{worker_id}.log"
        cmd = [
            sys.executable, "-m", "hotpool", "worker",
            "--worker-id", worker_id,
            "--control-plane", c.control_plane_url,
            "--cache-dir", str(c.cache_dir),
            "--device", c.device,
            "--log-level", c.log_level,
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        # The token travels in the environment, never on a command line others can read.
        env = {**os.environ, "HOTPOOL_WORKER_TOKEN": c.token}
        proc = await asyncio.to_thread(_spawn, cmd, env, log_path)
        self._procs[worker_id] = proc
        return WorkerHandle(worker_id, proc.pid, str(log_path))

    async def stop(self, handle: WorkerHandle, grace_s: float = 10.0) -> None:
        proc = self._procs.pop(handle.worker_id, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)

    def exit_reason(self, handle: WorkerHandle) -> str | None:
        proc = self._procs.get(handle.worker_id)
        if proc is None:
            return "stopped"
        code = proc.poll()
        if code is None:
            return None
        tail = _tail(handle.log_path)
        return f"worker process exited with code {code}" + (f": {tail}" if tail else "")


def _spawn(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


def _tail(path: str | None, lines: int = 5) -> str:
    if not path or not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])
