"""Workers on a Ray cluster: one Ray actor per worker, placed wherever Ray has room.

Each actor asks Ray for one GPU (``num_gpus=1``) on a GPU cluster, or for
``HOTPOOL_RAY_WORKER_CPUS`` CPUs on a CPU cluster, and runs ``python -m hotpool worker`` as
its child process on the node Ray picked. A child process rather than the worker inside the
actor, so the worker is the very same program the local backend runs (its own event loop,
signals, log file) and Ray keeps only what it is good at: placement, GPU assignment (Ray sets
``CUDA_VISIBLE_DEVICES`` on the actor, the child inherits it) and noticing death.

- **Address**: the child binds the node's IP as Ray reports it and registers that address,
  so the control plane reaches workers on other machines (never 127.0.0.1 across nodes).
- **Settings**: the control plane's ``HOTPOOL_*`` settings are forwarded to the worker; a
  node's own ``HOTPOOL_*`` environment wins (its cache dir, its KV budget). The worker's
  snapshot cache and log file (``<home>/logs/<worker id>.log``) are on its node.
- **Stop**: the actor SIGTERMs its child (SIGKILL after the grace period), then the backend
  kills the actor, which frees its GPU or CPUs in Ray.
- **Death**: the backend holds the ObjectRef of the actor's long-running ``run`` method; it
  resolves when the child exits (with its exit code) and fails with ``RayActorError`` when
  the actor dies (``ray.kill``, node lost, OOM). :meth:`RayWorkerBackend.exit_reason` polls
  it without blocking, so the pool's dead-worker path replaces the worker as it does for a
  dead local process. A killed actor's child sees its parent gone and exits (``--parent-pid``).

``ray`` is imported only here and only when this backend is chosen (``HOTPOOL_BACKEND=ray``):
the default install does not need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotpool.pool.backend import WorkerBackend, WorkerHandle
from hotpool.settings import load_settings

log = logging.getLogger("hotpool.pool")

NAMESPACE = "hotpool"
ACTOR_PREFIX = "hotpool-worker-"


def actor_name(worker_id: str) -> str:
    """The actor's name in namespace ``hotpool``: operators find a worker with
    ``ray.get_actor(actor_name(id), namespace="hotpool")``."""
    return ACTOR_PREFIX + worker_id


def init_address(address: str | None) -> str:
    """What ``ray.init`` is given: the configured cluster, else ``"local"``.

    Not ``None``: Ray would then join whatever cluster ``RAY_ADDRESS`` or
    ``/tmp/ray`` on this machine points at, and an unset setting must mean a private
    local cluster."""
    return address or "local"


def wants_gpu(device: str, cluster_gpus: float) -> bool:
    """``cuda`` always asks for a GPU (an autoscaler may add GPU nodes); ``auto`` does when
    the cluster has GPUs now; ``cpu`` never does."""
    return device == "cuda" or (device == "auto" and cluster_gpus > 0)


def actor_resources(gpu: bool, cpus: float) -> dict[str, float]:
    """The resources one worker actor holds while it lives."""
    return {"num_cpus": cpus, "num_gpus": 1 if gpu else 0}


def worker_threads(threads: int | None, cpus: float) -> int:
    """CPU threads of one worker: the setting, else the CPUs it holds (at least one)."""
    return threads if threads is not None else max(1, int(cpus))


# Never sent to the nodes: the token travels apart (never inherited by accident), the
# database URL holds the ledger's password while workers never touch the ledger, and an
# API key in the control plane's environment (the CLI's) has no business on a worker node.
NOT_FORWARDED = frozenset({"HOTPOOL_WORKER_TOKEN", "HOTPOOL_DATABASE_URL", "HOTPOOL_API_KEY"})


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The control plane's ``HOTPOOL_*`` settings a remote worker needs (KV cache size,
    batch limits, snapshot cache, S3 endpoint...): a Ray worker inherits its node's
    environment, not the control plane's. Object store credentials are not forwarded
    either: the nodes carry their own."""
    return {k: v for k, v in environ.items() if k.startswith("HOTPOOL_") and k not in NOT_FORWARDED}


def worker_env(
    node_env: Mapping[str, str], forwarded: Mapping[str, str], token: str, threads: int
) -> dict[str, str]:
    """A worker's environment on its node: the node's own (Ray's, with the actor's
    ``CUDA_VISIBLE_DEVICES``), whose ``HOTPOOL_*`` settings win, so a node group can set
    its own cache dir or KV budget; the control plane's settings fill the rest."""
    return {
        **forwarded,
        **node_env,
        "HOTPOOL_WORKER_TOKEN": token,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }


def worker_command(
    python: str,
    worker_id: str,
    control_plane_url: str,
    device: str,
    log_level: str,
    host: str,
    parent_pid: int,
) -> list[str]:
    """The worker's command line on its node. The token travels in its environment; the
    cache dir is the worker's own setting there (``HOTPOOL_CACHE_DIR`` or the home's)."""
    return [
        python, "-m", "hotpool", "worker",
        "--worker-id", worker_id,
        "--control-plane", control_plane_url,
        "--device", device,
        "--log-level", log_level,
        "--host", host,
        "--parent-pid", str(parent_pid),
    ]  # fmt: skip


@dataclass(frozen=True)
class RayWorkerConfig:
    control_plane_url: str  # as workers on any node reach it
    token: str
    device: str = "auto"
    log_level: str = "info"
    cpus_per_worker: float = 1.0
    threads: int | None = None  # None: the CPUs each worker holds
    env: dict[str, str] = field(default_factory=dict)  # forwarded settings (forwarded_env)


class WorkerActor:
    """Lives on the node Ray placed it on; runs and ends one worker process there.

    Made a Ray actor by :meth:`RayWorkerBackend.start` (``ray.remote`` needs ``ray``, which
    this module does not import at the top). Its methods are async, so ``terminate`` and
    ``where`` run while ``run`` waits."""

    def __init__(self, worker_id: str, config: RayWorkerConfig, device: str) -> None:
        import ray

        self.worker_id = worker_id
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        threads = worker_threads(config.threads, config.cpus_per_worker)
        env = worker_env(os.environ, config.env, config.token, threads)
        # The worker's own settings on this node say where its home (and log) is.
        log_dir = load_settings(env).home / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{worker_id}.log"
        cmd = worker_command(
            sys.executable, worker_id, config.control_plane_url, device, config.log_level,
            self.node_ip, os.getpid(),
        )  # fmt: skip
        # Started here, not in run(): a failure to start is then the actor's creation error,
        # which the backend reports as the worker's exit reason.
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    async def run(self) -> tuple[int, str]:
        """Resolves when the worker process ends: its exit code and its log's last lines."""
        while self.proc.poll() is None:  # noqa: ASYNC110 (a child process has no awaitable)
            await asyncio.sleep(0.2)
        return self.proc.returncode, _tail(self.log_path)

    async def terminate(self, grace_s: float) -> None:
        """SIGTERM the worker (SIGKILL after ``grace_s``; 0 = at once) and wait for it."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.proc.poll() is None and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)

    async def where(self) -> dict[str, Any]:
        """Where this worker runs: Ray node id and IP, the worker's pid and log file."""
        return {
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "pid": self.proc.pid,
            "log_path": str(self.log_path),
        }


@dataclass
class _Actor:
    handle: Any  # ray.actor.ActorHandle
    done: Any  # ObjectRef of WorkerActor.run: resolves when the worker ends
    placed: Any  # ObjectRef of WorkerActor.where: resolves once the actor runs somewhere
    reason: str | None = None  # cached once known: the ref resolves once


class RayWorkerBackend(WorkerBackend):
    """Starts workers as Ray actors; call :func:`connect` first (``ray.init``)."""

    def __init__(self, config: RayWorkerConfig, cluster_gpus: float) -> None:
        self.config = config
        self.gpu = wants_gpu(config.device, cluster_gpus)
        self._actors: dict[str, _Actor] = {}
        if config.device == "cuda" and cluster_gpus == 0:
            log.warning("HOTPOOL_DEVICE=cuda but the Ray cluster has no GPU: workers will wait")

    async def start(self, worker_id: str) -> WorkerHandle:
        options = actor_resources(self.gpu, self.config.cpus_per_worker)
        cls = _actor_class().options(
            name=actor_name(worker_id), namespace=NAMESPACE, max_restarts=0, **options
        )
        device = "cuda" if self.gpu else "cpu"
        # These calls only submit: Ray schedules the actor (maybe waiting for room) on its own.
        actor = cls.remote(worker_id, self.config, device)
        self._actors[worker_id] = _Actor(actor, actor.run.remote(), actor.where.remote())
        # No pid or log path here: both are on a node not chosen yet (see WorkerActor.where).
        return WorkerHandle(worker_id)

    async def stop(self, handle: WorkerHandle, grace_s: float = 10.0) -> None:
        import ray

        entry = self._actors.pop(handle.worker_id, None)
        if entry is None:
            return
        if grace_s > 0 and entry.reason is None and _resolved(entry.placed):
            # Bounded: an actor that dies meanwhile never answers; it is killed all the same.
            with contextlib.suppress(Exception):
                await asyncio.to_thread(
                    ray.get, entry.handle.terminate.remote(grace_s), timeout=grace_s + 5
                )
        # Frees the actor's resources (a pending one never runs); a worker still running
        # exits once its parent, the actor, is gone.
        with contextlib.suppress(Exception):
            ray.kill(entry.handle, no_restart=True)

    def exit_reason(self, handle: WorkerHandle) -> str | None:
        entry = self._actors.get(handle.worker_id)
        if entry is None:
            return "stopped"
        if entry.reason is None:
            entry.reason = _ended(entry.done, handle.worker_id)
        return entry.reason


@functools.cache
def _actor_class() -> Any:
    """``WorkerActor`` as a Ray actor class, made once (Ray exports it to the cluster)."""
    import ray

    return ray.remote(WorkerActor)


def _resolved(ref: Any) -> bool:
    """Whether ``ref`` has a value or an error now (never blocks)."""
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


def _ended(done: Any, worker_id: str) -> str | None:
    """Why the actor's ``run`` ended, or None while it runs (never blocks)."""
    import ray
    from ray.exceptions import RayActorError, RayError

    try:
        if not _resolved(done):
            return None
    except Exception as exc:  # the cluster is unreachable: heartbeats still judge the worker
        log.debug("cannot ask Ray about %s: %s", actor_name(worker_id), exc)
        return None
    try:
        code, tail = ray.get(done, timeout=0)
    except RayActorError as exc:
        return f"Ray actor {actor_name(worker_id)} died: {death_cause(exc)}"
    except RayError as exc:
        return f"Ray actor {actor_name(worker_id)} failed: {death_cause(exc)}"
    return f"worker process exited with code {code}" + (f": {tail}" if tail else "")


def connect(address: str | None) -> tuple[str, float]:
    """Join the cluster at ``address`` (``auto``, ``host:port``, ``ray://host:port``) or
    start a private local one (None). Returns the IP this process has in the cluster (how
    workers on other nodes can reach it) and the cluster's GPU count."""
    import ray

    ray.init(
        address=init_address(address),
        namespace=NAMESPACE,
        log_to_driver=False,  # workers keep their own log files; the control plane's stays clean
        ignore_reinit_error=True,
    )
    gpus = float(ray.cluster_resources().get("GPU", 0))
    return ray.util.get_node_ip_address(), gpus


def death_cause(exc: BaseException) -> str:
    """One line of Ray's error: its last line, which says why (``killed by ray.kill``, the
    node died, the exception of a failed start); the first is a generic preamble."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _tail(path: Path, lines: int = 5) -> str:
    if not path.exists():
        return ""
    text = path.read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])
