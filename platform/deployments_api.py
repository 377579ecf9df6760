"""``/v1/deployments``: create, list and inspect deployments (update and delete: issue 7)."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.billing.deployments import DeploymentExists, DeploymentSpec
from hotpool.billing.scale_events import ScaleEventRecord
from hotpool.platform.auth import authorize, owned
from hotpool.platform.errors import APIError, invalid
from hotpool.platform.services import Services, read_json
from hotpool.worker.protocol import RUNNABLE_MODEL_TYPES

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
FIELDS = {
    "name",
    "snapshot_uri",
    "min_replicas",
    "max_replicas",
    "target_concurrency",
    "idle_timeout_s",
}


def parse_deployment(body: Any, default_idle_timeout_s: float) -> DeploymentSpec:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise invalid(f"unknown field `{unknown[0]}`", unknown[0])
    name = body.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(
            "`name` must be 1-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit",
            "name",
        )
    uri = body.get("snapshot_uri")
    if not isinstance(uri, str) or not uri.startswith(("file:///", "s3://")):
        raise invalid(
            "`snapshot_uri` must be a file:///absolute/path or s3://bucket/prefix URI",
            "snapshot_uri",
        )
    if uri.startswith("file://"):
        _check_local_snapshot(uri)
    min_r = _int(body, "min_replicas", 0, 0)
    max_r = _int(body, "max_replicas", 1, 1)
    if min_r > max_r:
        raise invalid("`min_replicas` must not exceed `max_replicas`", "min_replicas")
    idle = body.get("idle_timeout_s", default_idle_timeout_s)
    if isinstance(idle, bool) or not isinstance(idle, int | float) or not 0 < idle <= 7 * 86400:
        raise invalid(
            "`idle_timeout_s` must be a number of seconds in (0, 604800]", "idle_timeout_s"
        )
    return DeploymentSpec(
        name=name,
        snapshot_uri=uri.rstrip("/"),
        min_replicas=min_r,
        max_replicas=max_r,
        target_concurrency=_int(body, "target_concurrency", 8, 1),
        idle_timeout_s=float(idle),
    )


def _int(body: dict[str, Any], name: str, default: int, minimum: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise invalid(f"`{name}` must be an integer >= {minimum}", name)
    return value


def deployment_json(spec: DeploymentSpec, services: Services) -> dict[str, Any]:
    replicas = services.pool.replicas(spec.name)
    return {
        "object": "deployment",
        "name": spec.name,
        "snapshot_uri": spec.snapshot_uri,
        "scaling": {
            "min_replicas": spec.min_replicas,
            "max_replicas": spec.max_replicas,
            "target_concurrency": spec.target_concurrency,
            "idle_timeout_s": spec.idle_timeout_s,
        },
        "created_at": int(spec.created_at.timestamp()) if spec.created_at else None,
        "queued_requests": services.router.waiting[spec.name],
        "replicas": [r.describe() for r in replicas],
    }


async def create_deployment(request: Request) -> Response:
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    spec = parse_deployment(await read_json(request), services.settings.default_idle_timeout_s)
    spec = replace(spec, tenant_id=principal.tenant_id)
    try:
        created = await services.catalog.create(spec)
    except DeploymentExists:
        raise APIError(
            409, f"deployment {spec.name!r} already exists", param="name", code="deployment_exists"
        ) from None
    return JSONResponse(deployment_json(created, services), status_code=201)


async def list_deployments(request: Request) -> Response:
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    mine = (s for s in services.catalog.all().values() if s.tenant_id == principal.tenant_id)
    specs = sorted(mine, key=lambda s: s.name)
    return JSONResponse({"object": "list", "data": [deployment_json(s, services) for s in specs]})


async def get_deployment(request: Request) -> Response:
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    name = request.path_params["name"]
    spec = owned(services.catalog.get(name), principal)
    if spec is None:
        raise APIError(404, f"deployment {name!r} does not exist", code="deployment_not_found")
    return JSONResponse(deployment_json(spec, services))


async def list_scale_events(request: Request) -> Response:
    """``GET /v1/deployments/{name}/events?limit=&before=``: scale events, newest first."""
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    name = request.path_params["name"]
    if owned(services.catalog.get(name), principal) is None:
        raise APIError(404, f"deployment {name!r} does not exist", code="deployment_not_found")
    limit = _query_int(request, "limit", 100, 1, 1000)
    before = _query_int(request, "before", None, 1, None)
    await services.scale_events.flush()  # what the pool just did is in the answer
    events = await asyncio.to_thread(services.scale_events.store.list, name, limit + 1, before)
    page = events[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": [_event_json(e) for e in page],
            "has_more": len(events) > limit,
            "next_before": page[-1].id if len(events) > limit else None,
        }
    )


def _event_json(e: ScaleEventRecord) -> dict[str, Any]:
    return {
        "object": "scale_event",
        "id": e.id,
        "deployment": e.deployment,
        "from_replicas": e.from_replicas,
        "to_replicas": e.to_replicas,
        "reason": e.reason,
        "cold_start_seconds": e.cold_start_seconds,
        "error": e.error,
        "created_at": int(e.created_at.timestamp()) if e.created_at else None,
    }


def _query_int(
    request: Request, name: str, default: int | None, low: int, high: int | None
) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise invalid(f"`{name}` must be an integer {bound}", name)
    return value


routes = [
    Route("/v1/deployments", create_deployment, methods=["POST"]),
    Route("/v1/deployments", list_deployments, methods=["GET"]),
    Route("/v1/deployments/{name}", get_deployment, methods=["GET"]),
    Route("/v1/deployments/{name}/events", list_scale_events, methods=["GET"]),
]


def _check_local_snapshot(uri: str) -> None:
    """A local snapshot is checked now (an s3:// one when its first replica loads it): it
    must exist, have a manifest, and hold a model type the workers run. (The worker verifies
    the manifest in full when it loads the snapshot.)"""
    path = Path(uri.removeprefix("file://")) / "manifest.json"
    if not path.is_file():
        raise APIError(422, f"no snapshot at {uri} (manifest.json not found)", param="snapshot_uri")
    try:
        architecture = json.loads(path.read_text())["architecture"]
    except (OSError, ValueError, KeyError, TypeError):
        raise APIError(
            422, f"snapshot at {uri} has an unreadable manifest.json", param="snapshot_uri"
        ) from None
    if architecture not in RUNNABLE_MODEL_TYPES:
        raise APIError(
            422,
            f"snapshot at {uri} holds a {architecture!r} model; hotpool runs "
            f"{', '.join(RUNNABLE_MODEL_TYPES)}",
            param="snapshot_uri",
        )
