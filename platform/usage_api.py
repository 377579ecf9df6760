"""``GET /v1/usage``: token usage and cost per time bucket, shaped like OpenAI's organization
usage API (``/v1/organization/usage/completions``) so existing tooling reads it.

``group_by`` takes ``model`` or its alias ``deployment`` (a request's model is the
deployment's name), ``api_key`` (OpenAI's ``api_key_id``) and ``version`` (the deployment
version that served, hotpool's own), several at once, repeated or
comma-separated; ``models`` filters deployments. List parameters may also be spelled with
brackets (``group_by[]=model``), as the ``openai`` client sends them. Each result carries
``cost``, ``{"value": "0.000150", "currency": "USD"}``: the exact decimal of its integer
micro-units (``cost_micros``), or null when none of its requests had a price in force.
``tenant`` (a tenant's name) narrows an ``operator`` key's view to one tenant.
"""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.billing.prices import format_micros
from hotpool.billing.tenants import check_tenant_name
from hotpool.billing.usage import BUCKET_WIDTHS, UsageBucketRow, floor_to_bucket, usage_buckets
from hotpool.platform.auth import Principal, authorize
from hotpool.platform.errors import APIError, invalid
from hotpool.platform.services import Services

DEFAULT_LIMIT = {"1d": 7, "1h": 24, "1m": 60}
MAX_LIMIT = {"1d": 31, "1h": 168, "1m": 1440}
LIST_PARAMS = {"group_by", "models"}
PARAMS = {"start_time", "end_time", "bucket_width", "limit", "page", "tenant"} | LIST_PARAMS
PARAMS |= {f"{name}[]" for name in LIST_PARAMS}
# group_by value -> what billing groups by
GROUPS = {"model": "deployment", "deployment": "deployment", "api_key": "api_key",
          "api_key_id": "api_key", "version": "version"}  # fmt: skip
# 9999-01-01: a page of buckets after any accepted time still fits in a datetime.
MAX_TIMESTAMP = 253370764800


_INTEGER = re.compile(r"-?[0-9]{1,19}")
EPOCH = datetime.fromtimestamp(0, UTC)


def _int_param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    # ASCII digits only: int() also takes "1_000", " 7 " and other scripts' digits
    if not _INTEGER.fullmatch(raw):
        raise invalid(f"`{name}` must be an integer", name)
    return int(raw)


def _list_param(request: Request, name: str) -> list[str]:
    """Every value of ``name`` (or ``name[]``), repeated or comma-separated."""
    values = [*request.query_params.getlist(name), *request.query_params.getlist(f"{name}[]")]
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def time_param(request: Request, name: str) -> datetime | None:
    ts = _int_param(request, name)
    if ts is None:
        return None
    if not 0 <= ts < MAX_TIMESTAMP:
        raise invalid(f"`{name}` must be a Unix time in seconds from 0 to {MAX_TIMESTAMP}", name)
    return datetime.fromtimestamp(ts, UTC)


async def tenant_filter(request: Request, principal: Principal) -> int | None:
    """The tenant whose usage the caller asks for: its own, or for ``operator``, the one
    named by ``tenant`` (None: every tenant). Naming another tenant without ``operator`` is
    a 404, as an unknown one is, so that names of others do not leak."""
    name = request.query_params.get("tenant")
    if name is None:
        return None if principal.is_operator else principal.tenant_id
    services: Services = request.app.state.services
    try:
        check_tenant_name(name)  # a name no tenant can have needs no database query
        tenant = await asyncio.to_thread(services.tenants.by_name, name)
    except ValueError:
        tenant = None
    if tenant is None or not (principal.is_operator or tenant.id == principal.tenant_id):
        raise APIError(404, f"tenant {name!r} not found", param="tenant", code="tenant_not_found")
    return tenant.id


async def get_usage(request: Request) -> Response:
    """A tenant sees its own usage; an ``operator`` key sees every tenant's."""
    principal = await authorize(request, "usage")
    services: Services = request.app.state.services
    q = request.query_params
    unknown = sorted(set(q) - PARAMS)
    if unknown:
        raise invalid(f"unknown query parameter `{unknown[0]}`", unknown[0])
    width = q.get("bucket_width", "1d")
    if width not in BUCKET_WIDTHS:
        raise invalid("`bucket_width` must be one of 1m, 1h, 1d", "bucket_width")
    limit = _int_param(request, "limit")
    if limit is None:
        limit = DEFAULT_LIMIT[width]
    if not 1 <= limit <= MAX_LIMIT[width]:
        raise invalid(
            f"`limit` must be between 1 and {MAX_LIMIT[width]} for bucket_width={width}", "limit"
        )
    group_by = _list_param(request, "group_by")
    unsupported = [g for g in group_by if g not in GROUPS]
    if unsupported:
        raise invalid(
            f"cannot group by `{unsupported[0]}`; `group_by` takes {', '.join(GROUPS)}",
            "group_by",
        )
    groups = {GROUPS[g] for g in group_by}
    step = BUCKET_WIDTHS[width]
    end = time_param(request, "end_time") or datetime.now(UTC)
    # `page` is the cursor a previous answer gave as `next_page`: the next bucket's start.
    start = time_param(request, "page") or time_param(request, "start_time")
    if start is None:  # the last `limit` buckets before `end`, none before 1970
        start = max(floor_to_bucket(end, width) - (limit - 1) * step, EPOCH)
    if start >= end:
        raise invalid("`start_time` must be before `end_time`", "start_time")
    # Only this page's buckets are built and queried: a range of years in 1m buckets must
    # not enumerate millions of them.
    first = floor_to_bucket(start, width)
    total = -((first - end) // step)  # buckets that [start, end) touches
    starts = [first + i * step for i in range(min(limit, total))]
    page_end = min(end, starts[-1] + step)
    models = _list_param(request, "models") or None
    if models and not all(m.isascii() and m.isprintable() for m in models):
        raise invalid("`models` must be deployment names", "models")
    tenant = await tenant_filter(request, principal)
    rows = await asyncio.to_thread(
        usage_buckets,
        services.db,
        start,
        page_end,
        width,
        deployments=models,
        group_by=groups,
        tenant_id=tenant,
    )
    by_start: dict[datetime, list[UsageBucketRow]] = {}
    for row in rows:
        by_start.setdefault(row.start, []).append(row)
    data = [
        {
            "object": "bucket",
            "start_time": int(s.timestamp()),
            "end_time": int((s + step).timestamp()),
            "results": [_result(r) for r in by_start.get(s, [])],
        }
        for s in starts
    ]
    more = total > limit
    next_page = str(int((starts[-1] + step).timestamp())) if more else None
    return JSONResponse({"object": "page", "data": data, "has_more": more, "next_page": next_page})


def _result(row: UsageBucketRow) -> dict[str, Any]:
    cost = row.cost_micros
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": row.prompt_tokens,
        "input_cached_tokens": row.cached_tokens,
        "output_tokens": row.completion_tokens,
        "num_model_requests": row.requests,
        "model": row.deployment,
        "project_id": None,
        "user_id": None,
        "api_key_id": row.api_key,
        "batch": None,
        "cost": None if cost is None else {"value": format_micros(cost), "currency": row.currency},
        "cost_micros": cost,
        "version": row.version,  # hotpool: the deployment version, when grouped by it
    }


routes = [Route("/v1/usage", get_usage, methods=["GET"])]
