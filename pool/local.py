"""Worker processes on this machine: ``python -m hotpool worker`` per worker.

On a GPU host each worker gets one GPU of its own (``CUDA_VISIBLE_DEVICES``); on a CPU host
the cores are split between workers (``OMP_NUM_THREADS``), because two busy workers each
spinning as many threads as there are cores run slower together than one alone.
"""

from __future__ import annotations

import asyncio
import os
import shutil
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
    threads: int | None = None  # CPU threads per worker (None: the libraries' default)
    gpus: tuple[str, ...] = ()  # GPU ids to hand out, one per worker; () = no assignment


class NoFreeGPU(RuntimeError):
    """Every GPU already has a worker."""


class LocalProcessBackend(WorkerBackend):
    def __init__(self, config: LocalWorkerConfig) -> None:
        self.config = config
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._gpu_of: dict[str, str] = {}  # worker id -> the GPU it holds

    def worker_env(self, worker_id: str) -> dict[str, str]:
        """The environment of a new worker; takes a free GPU for it if there are GPUs."""
        c = self.config
        # The token travels in the environment, never on a command line others can read.
        env = {**os.environ, "HOTPOOL_WORKER_TOKEN": c.token}
        if c.threads is not None:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env[var] = str(c.threads)
        if c.gpus:
            busy = set(self._gpu_of.values())
            free = [g for g in c.gpus if g not in busy]
            if not free:
                raise NoFreeGPU(f"all {len(c.gpus)} GPUs ({','.join(c.gpus)}) have a worker")
            self._gpu_of[worker_id] = free[0]
            env["CUDA_VISIBLE_DEVICES"] = free[0]
        return env

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
        env = self.worker_env(worker_id)
        try:
            proc = await asyncio.to_thread(_spawn, cmd, env, log_path)
        except BaseException:
            self._gpu_of.pop(worker_id, None)
            raise
        self._procs[worker_id] = proc
        return WorkerHandle(worker_id, proc.pid, str(log_path))

    async def stop(self, handle: WorkerHandle, grace_s: float = 10.0) -> None:
        self._gpu_of.pop(handle.worker_id, None)
        proc = self._procs.pop(handle.worker_id, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        try:
            await asyncio.to_thread(proc.wait, grace_s if grace_s > 0 else None)
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


def visible_gpus(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The GPUs this machine offers workers: ``CUDA_VISIBLE_DEVICES`` if set, else what
    ``nvidia-smi`` lists, else none (a CPU host)."""
    env = dict(os.environ) if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.splitlines() if line.strip())
