"""``/v1/tenants`` and ``/v1/keys``: what ``operator`` and ``admin`` keys manage.

An ``operator`` key runs the platform: it creates and lists tenants, and manages every
tenant's keys. An ``admin`` key manages its own tenant's keys only: another tenant is as
unknown to it as to anyone (404), and it cannot mint an ``operator`` key. A key is shown
once, in the answer that creates it; afterwards only its prefix is.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.billing.keys import ApiKeyRecord, parse_scopes
from hotpool.billing.tenants import TenantExists, TenantRecord
from hotpool.platform.auth import authorize
from hotpool.platform.errors import APIError, invalid, json_object
from hotpool.platform.services import Services, read_json


def _tenant_json(t: TenantRecord) -> dict[str, Any]:
    created = int(t.created_at.timestamp()) if t.created_at else None
    return {"object": "tenant", "id": t.id, "name": t.name, "created_at": created}


def _key_json(k: ApiKeyRecord, tenant: str | None) -> dict[str, Any]:
    def ts(value: Any) -> int | None:
        return int(value.timestamp()) if value else None

    return {
        "object": "api_key",
        "id": k.id,
        "prefix": k.prefix,
        "name": k.name,
        "tenant": tenant,
        "scopes": sorted(k.scopes),
        "created_at": ts(k.created_at),
        "last_used_at": ts(k.last_used_at),
        "revoked_at": ts(k.revoked_at),
    }


async def create_tenant(request: Request) -> Response:
    await authorize(request, "operator")
    services: Services = request.app.state.services
    body = json_object(await read_json(request), {"name"})
    name = body.get("name")
    if not isinstance(name, str):
        raise invalid("`name` must be a string", "name")
    try:
        tenant = await asyncio.to_thread(services.tenants.create, name)
    except TenantExists:
        raise APIError(409, f"tenant {name!r} already exists", param="name",
                       code="tenant_exists") from None  # fmt: skip
    except ValueError as exc:
        raise invalid(str(exc), "name") from None
    return JSONResponse(_tenant_json(tenant), status_code=201)


async def list_tenants(request: Request) -> Response:
    await authorize(request, "operator")
    services: Services = request.app.state.services
    tenants = await asyncio.to_thread(services.tenants.list)
    return JSONResponse({"object": "list", "data": [_tenant_json(t) for t in tenants]})


async def create_key(request: Request) -> Response:
    principal = await authorize(request, "admin")
    services: Services = request.app.state.services
    body = json_object(await read_json(request), {"tenant", "scopes", "name"})
    tenant_name, scopes, name = body.get("tenant"), body.get("scopes"), body.get("name")
    if tenant_name is not None and not isinstance(tenant_name, str):
        raise invalid("`tenant` must be a tenant's name (default: the caller's own)", "tenant")
    if not isinstance(scopes, list) or not all(isinstance(s, str) and "," not in s for s in scopes):
        raise invalid(
            "`scopes` must be a list of deploy, invoke, usage, admin (one scope a string)",
            "scopes",
        )
    if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= 128):
        raise invalid("`name` must be a string of 1 to 128 characters", "name")
    try:
        parsed = parse_scopes(",".join(scopes))
    except ValueError as exc:
        raise invalid(str(exc), "scopes") from None
    if "operator" in parsed and not principal.is_operator:
        raise APIError(
            403, "only an `operator` key can create `operator` keys", param="scopes",
            type="permission_error", code="insufficient_scope",
        )  # fmt: skip
    if tenant_name is None:
        tenant = await asyncio.to_thread(services.tenants.get, principal.tenant_id)
    else:
        tenant = await asyncio.to_thread(services.tenants.by_name, tenant_name)
    if tenant is None or not (principal.is_operator or tenant.id == principal.tenant_id):
        raise APIError(404, f"tenant {tenant_name!r} does not exist", param="tenant",
                       code="tenant_not_found")  # fmt: skip
    key, plaintext = await asyncio.to_thread(services.keys.create, tenant.id, parsed, name)
    return JSONResponse({**_key_json(key, tenant.name), "key": plaintext}, status_code=201)


async def list_keys(request: Request) -> Response:
    principal = await authorize(request, "admin")
    services: Services = request.app.state.services
    names = {t.id: t.name for t in await asyncio.to_thread(services.tenants.list)}
    only = None if principal.is_operator else principal.tenant_id
    keys = await asyncio.to_thread(services.keys.list, only)
    return JSONResponse(
        {"object": "list", "data": [_key_json(k, names.get(k.tenant_id)) for k in keys]}
    )


async def revoke_key(request: Request) -> Response:
    principal = await authorize(request, "admin")
    services: Services = request.app.state.services
    prefix = request.path_params["prefix"]
    only = None if principal.is_operator else principal.tenant_id
    try:
        key = await asyncio.to_thread(services.keys.revoke, prefix, only)
        services.auth.forget(key.id)
    except KeyError:
        raise APIError(
            404, f"no API key with prefix {prefix!r}", code="api_key_not_found"
        ) from None
    tenant = await asyncio.to_thread(services.tenants.get, key.tenant_id)
    return JSONResponse(_key_json(key, tenant.name if tenant else None))


routes = [
    Route("/v1/tenants", create_tenant, methods=["POST"]),
    Route("/v1/tenants", list_tenants, methods=["GET"]),
    Route("/v1/keys", create_key, methods=["POST"]),
    Route("/v1/keys", list_keys, methods=["GET"]),
    Route("/v1/keys/{prefix}", revoke_key, methods=["DELETE"]),
]
