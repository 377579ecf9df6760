"""``GET /v1/usage``: token usage per time bucket, shaped like OpenAI's organization
usage API (``/v1/organization/usage/completions``) so existing tooling reads it."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.billing.usage import BUCKET_WIDTHS, UsageBucketRow, floor_to_bucket, usage_buckets
from hotpool.platform.auth import authorize
from hotpool.platform.errors import invalid
from hotpool.platform.services import Services

DEFAULT_LIMIT = {"1d": 7, "1h": 24, "1m": 60}
MAX_LIMIT = {"1d": 31, "1h": 168, "1m": 1440}
PARAMS = {"start_time", "end_time", "bucket_width", "group_by", "models", "limit", "page"}
# 9999-01-01: a page of buckets after any accepted time still fits in a datetime.
MAX_TIMESTAMP = 253370764800


def _int_param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise invalid(f"`{name}` must be an integer", name) from None


def _time_param(request: Request, name: str) -> datetime | None:
    ts = _int_param(request, name)
    if ts is None:
        return None
    if not 0 <= ts < MAX_TIMESTAMP:
        raise invalid(f"`{name}` must be a Unix time in seconds from 0 to {MAX_TIMESTAMP}", name)
    return datetime.fromtimestamp(ts, UTC)


async def get_usage(request: Request) -> Response:
    """A tenant sees its own usage; an ``admin`` key sees every tenant's."""
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
    group_by = q.get("group_by")
    if group_by not in (None, "model"):
        raise invalid("`group_by` supports only `model`", "group_by")
    step = BUCKET_WIDTHS[width]
    end = _time_param(request, "end_time") or datetime.now(UTC)
    # `page` is the cursor a previous answer gave as `next_page`: the next bucket's start.
    start = _time_param(request, "page") or _time_param(request, "start_time")
    if start is None:
        start = floor_to_bucket(end, width) - (limit - 1) * step
    if start >= end:
        raise invalid("`start_time` must be before `end_time`", "start_time")
    # Only this page's buckets are built and queried: a range of years in 1m buckets must
    # not enumerate millions of them.
    first = floor_to_bucket(start, width)
    total = -((first - end) // step)  # buckets that [start, end) touches
    starts = [first + i * step for i in range(min(limit, total))]
    page_end = min(end, starts[-1] + step)
    model = q.get("models")
    tenant = None if principal.is_admin else principal.tenant_id
    rows = await asyncio.to_thread(
        usage_buckets, services.db, start, page_end, width, model, group_by == "model", tenant
    )
    by_start: dict[datetime, list[UsageBucketRow]] = {}
    for row in rows:
        by_start.setdefault(row.start, []).append(row)
    data = [
        {
            "object": "bucket",
            "start_time": int(s.timestamp()),
            "end_time": int((s + step).timestamp()),
            "results": [_result(r, group_by == "model") for r in by_start.get(s, [])],
        }
        for s in starts
    ]
    more = total > limit
    next_page = str(int((starts[-1] + step).timestamp())) if more else None
    return JSONResponse({"object": "page", "data": data, "has_more": more, "next_page": next_page})


def _result(row: UsageBucketRow, grouped: bool) -> dict[str, Any]:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": row.prompt_tokens,
        "input_cached_tokens": row.cached_tokens,
        "output_tokens": row.completion_tokens,
        "num_model_requests": row.requests,
        "model": row.deployment if grouped else None,
        "project_id": None,
        "user_id": None,
        "api_key_id": None,
        "batch": None,
    }


routes = [Route("/v1/usage", get_usage, methods=["GET"])]
