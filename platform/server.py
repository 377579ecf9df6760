"""``hotpool serve``: the control plane and its local worker pool in one process."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable
from dataclasses import replace

import uvicorn

from hotpool.billing.db import Database, DatabaseUnavailable, StaleSchema, explained
from hotpool.billing.deployments import DeploymentSpec, DeploymentStore
from hotpool.heap import settle_heap
from hotpool.http_protocol import HeadCorkedHttpToolsProtocol
from hotpool.platform.app import build_services, create_app
from hotpool.platform.ledger_writer import SpoolUnavailable, lock_spool
from hotpool.pool.backend import WorkerBackend
from hotpool.pool.local import LocalProcessBackend, LocalWorkerConfig, visible_gpus
from hotpool.settings import Settings

log = logging.getLogger("hotpool")

SWITCH_INTERVAL_S = 0.0005  # the GIL's hand-over time to the event loop (see serve())


class StartupError(RuntimeError):
    """hotpool cannot start with these settings; the message says what to do."""


def open_database(settings: Settings) -> Database:
    """SQLite is upgraded automatically; a server database must be upgraded on purpose."""
    try:
        with explained(settings.database_url):
            db = Database(settings.database_url)
    except DatabaseUnavailable as exc:
        raise StartupError(str(exc)) from None
    try:
        with explained(settings.database_url):
            db.ensure_schema()
    except (StaleSchema, DatabaseUnavailable) as exc:
        db.dispose()
        raise StartupError(str(exc)) from None
    return db


def control_plane_url(settings: Settings, host: str, port: int, cluster_ip: str | None) -> str:
    """How workers reach the control plane: ``HOTPOOL_CONTROL_PLANE_URL``, else the bound
    address; a wildcard bind is reached at ``cluster_ip`` (this machine's IP in the Ray
    cluster), or at loopback when workers are local."""
    if settings.control_plane_url:
        return settings.control_plane_url
    if host in ("0.0.0.0", "::", ""):
        host = cluster_ip or "127.0.0.1"
    return f"http://{host}:{port}"


def local_backend(
    settings: Settings, host: str, port: int, token: str
) -> tuple[Settings, LocalProcessBackend]:
    """Worker processes on this machine; at most one worker per GPU on a GPU host."""
    gpus = visible_gpus() if settings.device != "cpu" else ()
    if gpus and settings.max_workers > len(gpus):
        log.info("%d GPU(s): at most %d workers, one per GPU", len(gpus), len(gpus))
        settings = replace(settings, max_workers=len(gpus))
    threads = settings.worker_threads or max(1, (os.cpu_count() or 1) // settings.max_workers)
    backend = LocalProcessBackend(
        LocalWorkerConfig(
            control_plane_url=control_plane_url(settings, host, port, None),
            token=token,
            cache_dir=settings.cache_dir,
            log_dir=settings.home / "logs",
            device=settings.device,
            log_level=settings.log_level,
            threads=threads,
            gpus=gpus,
        )
    )
    return settings, backend


def ray_backend(settings: Settings, host: str, port: int, token: str) -> WorkerBackend:
    """Worker actors on a Ray cluster (``ray`` is imported only on this path)."""
    from hotpool.pool import ray_backend as rb

    try:
        cluster_ip, gpus = rb.connect(settings.ray_address)
    except ImportError as exc:
        raise StartupError(
            f"HOTPOOL_BACKEND=ray needs Ray: pip install 'hotpool[ray]' ({exc})"
        ) from None
    except (ConnectionError, RuntimeError) as exc:
        where = settings.ray_address or "a new local cluster"
        raise StartupError(
            f"cannot connect to Ray at {where} (HOTPOOL_RAY_ADDRESS): {exc}"
        ) from None
    url = control_plane_url(settings, host, port, cluster_ip)
    log.info("Ray cluster joined as %s (%g GPUs); workers reach us at %s", cluster_ip, gpus, url)
    config = rb.RayWorkerConfig(
        control_plane_url=url,
        token=token,
        device=settings.device,
        log_level=settings.log_level,
        cpus_per_worker=settings.ray_worker_cpus,
        threads=settings.worker_threads,
        env=rb.forwarded_env(os.environ),
    )
    return rb.RayWorkerBackend(config, gpus)


def _check_spool_free(settings: Settings) -> None:
    """Fail before the banner when another control plane serves this home: the ledger
    writer would only find out in the app's start-up, after "serving on" and in a traceback.
    (The writer takes the lock for good at start-up; this look is released at once.)"""
    try:
        os.close(lock_spool(settings.ledger_spool_dir))
    except SpoolUnavailable as exc:
        raise StartupError(
            f"{exc} (is another `hotpool serve` running on {settings.home}?)"
        ) from None
    except OSError as exc:
        raise StartupError(
            f"cannot use the spool folder {settings.ledger_spool_dir} (HOTPOOL_SPOOL_DIR): "
            f"{exc.strerror or exc}"
        ) from None


def serve(settings: Settings, deploy: list[DeploymentSpec] | None = None) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per worker call otherwise
    try:
        settings.home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(
            f"HOTPOOL_HOME {settings.home} is not a folder hotpool can use: {exc.strerror or exc}"
        ) from None
    _check_spool_free(settings)
    db = open_database(settings)
    store = DeploymentStore(db)
    for spec in deploy or []:
        if store.get(spec.name) is None:
            store.create(spec)
            log.info(
                "deployed %s from %s (scaled to zero until its first request)",
                spec.name,
                spec.snapshot_uri,
            )
    # Bind first, so the workers learn the real port even when HOTPOOL_PORT=0.
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for a
    # socket made with it, and without it each streamed chunk can wait ~40 ms (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        raise StartupError(
            f"cannot listen on {settings.host}:{settings.port} ({exc.strerror}); "
            "set HOTPOOL_PORT or --port to another port"
        ) from None
    host, port = sock.getsockname()[:2]
    token = settings.worker_token or secrets.token_urlsafe(32)
    if settings.backend == "ray":
        backend: WorkerBackend = ray_backend(settings, host, port, token)
    else:
        settings, backend = local_backend(settings, host, port, token)
    services = build_services(settings, db, backend, token)
    app = create_app(services)
    banner = (
        f"hotpool is serving on http://{host}:{port} (data in {settings.home});"
        f" dashboard: http://{host}:{port}/dashboard"
    )
    if settings.log_format == "json":  # every line a JSON object, standard output's too
        log.info("%s", banner, extra={"url": f"http://{host}:{port}", "home": str(settings.home)})
    else:
        print(banner, flush=True)
    # The event loop relays every token; the ledger writer's batches (SQLAlchemy, ~4 ms of
    # Python for 32 records) run in a thread. A thread that wants the GIL waits out the
    # holder's switch interval (5 ms by default) before it is handed over, so a batch in
    # flight held up every stream by up to 5 ms; at 0.5 ms the batch is interleaved with the
    # relay in slices too short to show as latency.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    settle_heap()  # start-up's objects out of the collector's full passes (hotpool.heap)
    # log_config=None: uvicorn's loggers go through hotpool's handler (text or JSON).
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        log_config=None,
        timeout_graceful_shutdown=30,
        access_log=False,  # hotpool.access logs each request once it is over (middleware)
        # A stream's headers and first token in one write; slow heads and bodies cut off.
        http=HeadCorkedHttpToolsProtocol.with_read_timeouts(
            settings.head_timeout_s, settings.body_timeout_s
        ),
    )
    ControlPlaneServer(config, services.begin_shutdown).run(sockets=[sock])


class ControlPlaneServer(uvicorn.Server):
    """uvicorn's server, which tells the control plane when a graceful stop begins: uvicorn
    closes every listener then, the one workers send heartbeats to included, and drains
    the running requests for up to ``timeout_graceful_shutdown`` seconds. Without a word,
    the pool took the missing heartbeats for dead workers and cut their streams."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_stop = on_stop

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_stop()
        await super().shutdown(sockets)
