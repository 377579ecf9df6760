"""``/v1/deployments``: create, list, inspect, update and delete deployments, and their
versions.

An update that changes what replicas run (snapshot, dtype, quantization, context length, KV
budget) creates a new version. By default it is rolled out at once: the autoscaler brings up new
replicas and drains the old ones once one is ready, so no request is dropped. With
``canary`` it takes only a share of the requests, next to the stable version, until
``promote`` makes it stable or ``rollback`` returns all traffic to the stable version. A
delete drains every replica; its usage stays in the ledger.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.billing.deployments import (
    DeploymentExists,
    DeploymentNotFound,
    DeploymentSpec,
    VersionConflict,
    VersionNotFound,
)
from hotpool.billing.scale_events import ScaleEventRecord
from hotpool.billing.versions import VersionRecord
from hotpool.platform.answer_bounds import answer_bounds_json
from hotpool.platform.auth import Principal, authorize, owned
from hotpool.platform.deployment_schema import REPLICA_FIELDS, parse_deployment, parse_update
from hotpool.platform.errors import APIError, invalid
from hotpool.platform.services import Services, read_json

MAX_EVENTS_PAGE = 1000
MAX_EVENT_ID = (1 << 63) - 1  # a BIGINT: a larger `before` would overflow in SQL


def speculative_json(text: str | None) -> dict[str, Any] | None:
    """The stored policy as the API shows it (the store keeps its canonical JSON text)."""
    return None if text is None else json.loads(text)  # type: ignore[no-any-return]


def deployment_json(spec: DeploymentSpec, services: Services) -> dict[str, Any]:
    replicas = services.pool.replicas(spec.name)
    settings = services.settings
    last = max(
        (r for r in replicas if r.cold_start_seconds is not None),
        key=lambda r: r.created_at,
        default=None,
    )
    return {
        "object": "deployment",
        "name": spec.name,
        "snapshot_uri": spec.snapshot_uri,
        "generation": spec.generation,
        "version": spec.generation,  # the stable version
        "previous_version": spec.previous_version,
        "canary": None
        if spec.canary_version is None
        else {"version": spec.canary_version, "percent": spec.canary_percent},
        "scaling": {
            "min_replicas": spec.min_replicas,
            "max_replicas": spec.max_replicas,
            "target_concurrency": spec.target_concurrency,
            "idle_timeout_s": spec.idle_timeout_s,
            "max_queue": spec.max_queue or settings.max_queue,
            "queue_timeout_s": spec.queue_timeout_s or settings.queue_timeout_s,
        },
        "engine": {
            "dtype": spec.dtype,  # null: the snapshot's own
            "quantization": spec.quantization,
            "speculative": speculative_json(spec.speculative),  # null: no speculation
            "max_model_len": spec.max_model_len,  # null: the model's own
            "kv_cache_bytes": spec.kv_cache_bytes or settings.kv_cache_bytes,
        },
        "answers": answer_bounds_json(spec),
        "created_at": int(spec.created_at.timestamp()) if spec.created_at else None,
        "queued_requests": services.router.waiting[spec.name],
        "replicas": [r.describe() for r in replicas],
        "last_cold_start": None
        if last is None
        else {"seconds": last.cold_start_seconds, "phases": last.describe()["cold_start_phases"]},
    }


def _within_pool(min_replicas: int, services: Services) -> None:
    """The autoscaler starts ``min_replicas`` replicas at once: more than the pool's workers
    could never run, and a huge floor would stall the control plane creating them."""
    most = services.settings.max_workers
    if min_replicas > most:
        raise invalid(
            f"`min_replicas` must be at most the pool's max_workers ({most})", "min_replicas"
        )


def owned_or_404(services: Services, name: str, principal: Principal) -> DeploymentSpec:
    spec = owned(services.catalog.get(name), principal)
    if spec is None:
        raise APIError(404, f"deployment {name!r} does not exist", code="deployment_not_found")
    return spec


def _made_by(principal: Principal) -> str:
    """Who made a version: the key's prefix, or `local` without keys."""
    return principal.key.prefix if principal.key else "local"


async def _versioned(name: str, op: Awaitable[DeploymentSpec]) -> DeploymentSpec:
    """Run a catalog operation, turning the store's errors into API errors."""
    try:
        return await op
    except DeploymentNotFound:  # deleted meanwhile
        raise APIError(
            404, f"deployment {name!r} does not exist", code="deployment_not_found"
        ) from None
    except VersionNotFound as exc:
        raise APIError(404, str(exc), param="canary.version", code="version_not_found") from None
    except VersionConflict as exc:
        raise APIError(409, str(exc), code="version_conflict") from None


async def create_deployment(request: Request) -> Response:
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    settings = services.settings
    spec = parse_deployment(
        await read_json(request), settings.default_idle_timeout_s, settings.snapshots_dir
    )
    spec = replace(spec, tenant_id=principal.tenant_id)
    _within_pool(spec.min_replicas, services)
    try:
        created = await services.catalog.create(spec, _made_by(principal))
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
    spec = owned_or_404(services, request.path_params["name"], principal)
    return JSONResponse(deployment_json(spec, services))


async def update_deployment(request: Request) -> Response:
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    current = owned_or_404(services, request.path_params["name"], principal)
    update = parse_update(await read_json(request), current, services.settings.snapshots_dir)
    changes, canary = update.changes, update.canary
    if "min_replicas" in changes:
        _within_pool(changes["min_replicas"], services)
    catalog, name, by = services.catalog, current.name, _made_by(principal)
    updated = current
    if canary is not None and canary.version is None and not canary.clear:
        # New snapshot or engine options become a canary version; the rest applies now.
        new = {f: v for f, v in changes.items() if f in REPLICA_FIELDS}
        rest = {f: v for f, v in changes.items() if f not in REPLICA_FIELDS}
        if rest:
            updated = await _versioned(name, catalog.update(name, rest, by))
        assert canary.percent is not None
        updated = await _versioned(name, catalog.add_canary(name, canary.percent, new, by))
    else:
        if changes:
            updated = await _versioned(name, catalog.update(name, changes, by))
        if canary is not None:
            updated = await _versioned(
                name, catalog.set_canary(name, canary.version, canary.percent)
            )
    services.autoscaler.wake()  # roll over or rescale now, not at the next tick
    return JSONResponse(deployment_json(updated, services))


async def promote_deployment(request: Request) -> Response:
    """The canary becomes the stable version; the old stable version's replicas drain."""
    return await _version_action(request, "promote")


async def rollback_deployment(request: Request) -> Response:
    """All traffic back to the previous stable version, at once: during a canary, the
    stable version; otherwise the version stable before the last change."""
    return await _version_action(request, "rollback")


async def _version_action(request: Request, action: str) -> Response:
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    name = owned_or_404(services, request.path_params["name"], principal).name
    updated = await _versioned(name, getattr(services.catalog, action)(name))
    services.autoscaler.wake()  # drain what no longer serves now, not at the next tick
    return JSONResponse(deployment_json(updated, services))


async def list_versions(request: Request) -> Response:
    """``GET /v1/deployments/{name}/versions``: every version, oldest first."""
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    spec = owned_or_404(services, request.path_params["name"], principal)
    try:
        versions = await asyncio.to_thread(services.catalog.store.versions, spec.name)
    except DeploymentNotFound:
        raise APIError(
            404, f"deployment {spec.name!r} does not exist", code="deployment_not_found"
        ) from None
    return JSONResponse({"object": "list", "data": [_version_json(v, spec) for v in versions]})


def _version_json(v: VersionRecord, spec: DeploymentSpec) -> dict[str, Any]:
    if v.version == spec.generation:
        role, percent = "stable", 100.0 - (spec.canary_percent or 0.0)
    elif v.version == spec.canary_version:
        role, percent = "canary", spec.canary_percent
    else:
        role, percent = ("previous" if v.version == spec.previous_version else None), 0.0
    return {
        "object": "deployment.version",
        "version": v.version,
        "role": role,
        "traffic_percent": percent,
        "snapshot_uri": v.snapshot_uri,
        "engine": {
            "dtype": v.dtype,
            "quantization": v.quantization,
            "speculative": speculative_json(v.speculative),
            "max_model_len": v.max_model_len,
            "kv_cache_bytes": v.kv_cache_bytes,
        },
        "created_at": int(v.created_at.timestamp()) if v.created_at else None,
        "created_by": v.created_by,
        "changes": v.changes,
    }


async def delete_deployment(request: Request) -> Response:
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    spec = owned_or_404(services, request.path_params["name"], principal)
    try:
        await services.catalog.delete(spec.name)
    except DeploymentNotFound:
        raise APIError(
            404, f"deployment {spec.name!r} does not exist", code="deployment_not_found"
        ) from None
    # Its replicas stop taking requests now (a new deployment may take the name at once:
    # they must never serve it) and drain.
    services.pool.retire(spec.name)
    services.autoscaler.forget(spec.name)
    services.autoscaler.wake()
    return JSONResponse({"id": spec.name, "object": "deployment", "deleted": True})


async def list_scale_events(request: Request) -> Response:
    """``GET /v1/deployments/{name}/events?limit=&before=``: scale events, newest first."""
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    spec = owned_or_404(services, request.path_params["name"], principal)
    limit = _query_int(request, "limit", 100, 1, MAX_EVENTS_PAGE)
    before = _query_int(request, "before", None, 1, MAX_EVENT_ID)
    await services.scale_events.flush()  # what the pool just did is in the answer
    # This deployment's events only: not those of an earlier one of the same name, which
    # may have been another tenant's.
    events = await asyncio.to_thread(
        functools.partial(
            services.scale_events.store.list, spec.name, limit + 1, before,
            tenant_id=spec.tenant_id, since=spec.created_at,
        )
    )  # fmt: skip
    page = events[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": [event_json(e) for e in page],
            "has_more": len(events) > limit,
            "next_before": page[-1].id if len(events) > limit else None,
        }
    )


def event_json(e: ScaleEventRecord) -> dict[str, Any]:
    return {
        "object": "scale_event",
        "id": e.id,
        "deployment": e.deployment,
        "from_replicas": e.from_replicas,
        "to_replicas": e.to_replicas,
        "reason": e.reason,
        "cold_start_seconds": e.cold_start_seconds,
        "phases": dict(e.phases) if e.phases is not None else None,
        "error": e.error,
        "created_at": int(e.created_at.timestamp()) if e.created_at else None,
    }


def _query_int(
    request: Request, name: str, default: int | None, low: int, high: int | None
) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    # ASCII digits only, as /v1/usage reads its integers: int() would also take "1_0",
    # " 1", "+1" and other scripts' digits.
    value = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 20 else low - 1
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise invalid(f"`{name}` must be an integer {bound}", name)
    return value


routes = [
    Route("/v1/deployments", create_deployment, methods=["POST"]),
    Route("/v1/deployments", list_deployments, methods=["GET"]),
    Route("/v1/deployments/{name}", get_deployment, methods=["GET"]),
    Route("/v1/deployments/{name}", update_deployment, methods=["PATCH"]),
    Route("/v1/deployments/{name}", delete_deployment, methods=["DELETE"]),
    Route("/v1/deployments/{name}/events", list_scale_events, methods=["GET"]),
    Route("/v1/deployments/{name}/versions", list_versions, methods=["GET"]),
    Route("/v1/deployments/{name}/promote", promote_deployment, methods=["POST"]),
    Route("/v1/deployments/{name}/rollback", rollback_deployment, methods=["POST"]),
]
