"""``/internal/workers/*``: where workers register and heartbeat (worker token only)."""

from __future__ import annotations

import hmac

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
    try:
        services.registry.heartbeat(info)
    except UnknownWorker:
        raise APIError(404, f"worker {info.worker_id} is not registered") from None
    return JSONResponse({"status": "ok"})


routes = [
    Route("/internal/workers/register", register, methods=["POST"]),
    Route("/internal/workers/{worker_id}/heartbeat", heartbeat, methods=["POST"]),
]
