"""``/internal/workers/*``: where workers register and heartbeat (worker token only)."""

from __future__ import annotations

import hmac
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.platform.errors import APIError
from hotpool.platform.services import Services, read_json
from hotpool.pool.registry import UnknownWorker
from hotpool.worker.protocol import WorkerInfo


def _authorize(request: Request) -> Services:
    services: Services = request.app.state.services
    got = request.headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {services.worker_token}".encode()):
        raise APIError(401, "invalid worker token")
    return services


async def _info(request: Request) -> WorkerInfo:
    try:
        return WorkerInfo.from_json(await read_json(request))
    except TypeError as exc:
        raise APIError(400, f"malformed worker info: {exc}") from None


async def register(request: Request) -> Response:
    services = _authorize(request)
    info = await _info(request)
    info = replace(info, prefix_stored=None, prefix_removed=None, prefix_reset=False)
    try:
        services.registry.register(info)
    except UnknownWorker:
        raise APIError(
            410, f"worker {info.worker_id} was not started by this control plane"
        ) from None
    return JSONResponse({"status": "registered"})


async def heartbeat(request: Request) -> Response:
    services = _authorize(request)
    info = await _info(request)
    if info.worker_id != request.path_params["worker_id"]:
        raise APIError(400, "worker id in the path and the body differ")
    replica = services.pool.replica_on(info.worker_id)
    if replica is not None and info.loaded == replica.deployment:
        replica.capacity = info.capacity or replica.capacity
        replica.kv_cache_usage = info.kv_cache_usage
        replica.prefixes.report(
            info.prefix_stored or (), info.prefix_removed or (), info.prefix_reset,
            info.kv_block_size,
        )  # fmt: skip
    # The hashes live in the router's index only, never in what is shown of the worker.
    info = replace(info, prefix_stored=None, prefix_removed=None, prefix_reset=False)
    try:
        services.registry.heartbeat(info)
    except UnknownWorker:
        raise APIError(404, f"worker {info.worker_id} is not registered") from None
    # Speculation's counts go with a replica that goes: the dashboard keeps its last ones.
    services.spec_tally.observe(services.pool, services.catalog.all())
    return JSONResponse({"status": "ok"})


routes = [
    Route("/internal/workers/register", register, methods=["POST"]),
    Route("/internal/workers/{worker_id}/heartbeat", heartbeat, methods=["POST"]),
]
