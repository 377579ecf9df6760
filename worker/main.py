"""The worker process: start warm, register with the control plane, heartbeat, serve.

It binds its own port (0 = any free one) and tells the control plane the address, so a
pool can start many workers without choosing ports. It exits when its parent (the local
pool) dies, so a crashed control plane never leaves orphan workers holding GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
import uvicorn

from hotpool.heap import settle_heap
from hotpool.http_protocol import HeadCorkedHttpToolsProtocol
from hotpool.worker import idle_prep
from hotpool.worker.engine.llm_engine import EngineConfig
from hotpool.worker.engine.prefix_events import PrefixReport
from hotpool.worker.host_cache import HostModelCache
from hotpool.worker.protocol import WorkerInfo
from hotpool.worker.server import build_worker_app
from hotpool.worker.service import WorkerService, pick_device
from hotpool.worker.snapshot.cache import SnapshotCache

log = logging.getLogger("hotpool.worker")

HEARTBEAT_S = 2.0


@dataclass(frozen=True)
class WorkerOptions:
    worker_id: str
    control_plane_url: str
    token: str
    cache_dir: Path
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    parent_pid: int | None = None
    log_level: str = "info"
    snapshot_cache_bytes: int | None = None  # None: no limit
    host_cache_bytes: int = 0  # unloaded models kept in RAM
    engine: EngineConfig = field(default_factory=EngineConfig)


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_cache_usage(service: WorkerService) -> float | None:
    """The loaded engine's KV usage, for the heartbeat (the control plane's gauge).

    Read from this thread while the engine thread steps: a block count under the GIL, at
    worst one step stale, which a gauge sampled every few seconds does not mind."""
    loaded = service.loaded
    return None if loaded is None else loaded.engine.engine.stats().kv_usage


def spec_stats(service: WorkerService) -> tuple[int | None, int | None, bool | None]:
    """Speculative decoding's proposed and accepted tokens and the switch's state, for the
    heartbeat; Nones when the loaded engine does not speculate (or nothing is loaded)."""
    loaded = service.loaded
    if loaded is None or loaded.engine.engine.spec is None:
        return None, None, None
    s = loaded.engine.engine.stats()
    return s.spec_proposed, s.spec_accepted, s.spec_enabled


def prefix_report(service: WorkerService) -> tuple[int | None, PrefixReport | None]:
    """The loaded engine's block size and what its prefix cache stored and evicted since
    the last heartbeat; Nones with nothing loaded."""
    loaded = service.loaded
    if loaded is None:
        return None, None
    kv = loaded.engine.engine.kv_manager
    return kv.block_size, kv.pool.events.take()


def prefix_report_lost(service: WorkerService) -> None:
    """A heartbeat did not arrive: the next one tells the prefix cache's whole state."""
    loaded = service.loaded
    if loaded is not None:
        loaded.engine.engine.kv_manager.pool.events.lost()


def run_worker(opts: WorkerOptions) -> None:
    # httpx logs every call at info: a heartbeat line every two seconds otherwise (a failed
    # heartbeat is the worker's own warning).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(_main(opts))


async def _main(opts: WorkerOptions) -> None:
    device = pick_device(opts.device)
    if device.type == "cuda":
        torch.cuda.init()
    idle_prep.prepare_in_background(device)  # the first load's one-time costs, while idle
    service = WorkerService(
        SnapshotCache(opts.cache_dir, max_bytes=opts.snapshot_cache_bytes),
        device,
        opts.engine,
        HostModelCache(opts.host_cache_bytes),
        settle_heap=settle_heap,  # a model's objects out of the collector's full passes
    )
    server: uvicorn.Server | None = None  # made below, around the app

    def stopping() -> bool:
        return server is not None and server.should_exit

    app = build_worker_app(service, opts.token, opts.worker_id, stopping)
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for a
    # socket made with it, and without it each streamed chunk can wait ~40 ms (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((opts.host, opts.port))
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        log_level=opts.log_level,
        log_config=None,  # uvicorn's lines through the worker's handler (text or JSON)
        access_log=False,
        timeout_graceful_shutdown=10,
        http=HeadCorkedHttpToolsProtocol,  # a head leaves with its first body bytes
    )
    server = uvicorn.Server(config)

    def info() -> WorkerInfo:
        loaded = service.loaded
        block_size, report = prefix_report(service)
        return WorkerInfo(
            opts.worker_id,
            f"http://{host}:{port}",
            os.getpid(),
            str(device),
            device_memory(device),
            loaded.deployment if loaded else None,
            kv_cache_usage(service),
            *spec_stats(service),
            kv_block_size=block_size,
            prefix_stored=report.stored if report else None,
            prefix_removed=report.removed if report else None,
            prefix_reset=report.reset if report else False,
            capacity=loaded.capacity.curve if loaded else None,
        )

    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():  # noqa: ASYNC110 (uvicorn has only a flag)
        await asyncio.sleep(0.01)
    settle_heap()  # start-up's objects (torch's among them) out of the collector's full passes
    beat = asyncio.create_task(_heartbeat(opts, info, server, lambda: prefix_report_lost(service)))
    try:
        await serving
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        await service.unload()


async def _heartbeat(
    opts: WorkerOptions,
    info: Callable[[], WorkerInfo],
    server: uvicorn.Server,
    lost: Callable[[], None] = lambda: None,
) -> None:
    """Register, then heartbeat every ``HEARTBEAT_S``; ``lost`` is called when a payload
    may not have arrived (its prefix-cache changes are then sent again in full)."""
    headers = {"authorization": f"Bearer {opts.token}"}
    base = opts.control_plane_url.rstrip("/")
    registered = False
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
        while not server.should_exit:
            if opts.parent_pid is not None and os.getppid() != opts.parent_pid:
                log.warning("parent process %s is gone; worker exits", opts.parent_pid)
                server.should_exit = True
                return
            try:
                if not registered:
                    r = await client.post(
                        f"{base}/internal/workers/register", json=info().to_json()
                    )
                    if r.status_code == 410:  # not a worker this control plane wants
                        server.should_exit = True
                        return
                    r.raise_for_status()
                    registered = True
                    log.info("registered %s at %s", opts.worker_id, info().address)
                else:
                    r = await client.post(
                        f"{base}/internal/workers/{opts.worker_id}/heartbeat", json=info().to_json()
                    )
                    if r.status_code == 404:  # the control plane restarted and forgot us
                        registered = False
                        lost()
                        continue
                    if r.status_code == 410:  # the pool released this worker
                        server.should_exit = True
                        return
                    if r.status_code >= 400:
                        lost()
            except httpx.HTTPError as exc:
                lost()
                log.warning("control plane unreachable: %s", exc)
            await asyncio.sleep(HEARTBEAT_S if registered else 0.2)
