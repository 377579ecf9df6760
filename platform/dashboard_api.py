"""The small JSON endpoints the dashboard needs beside ``/v1/usage``.

``GET /v1/me`` says who a key is (the page's sign-in check, and whether to offer the
tenant filter). ``GET /v1/usage/summary`` gives, over a time range, requests by outcome,
latency percentiles and live replicas per deployment, and the scale events: what the
ledger's token sums do not. Both follow ``/v1/usage``'s rules: a tenant sees its own
deployments; an ``operator`` key sees every tenant's and may narrow to one with ``tenant``.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.billing.db import Database
from hotpool.billing.deployments import DeploymentSpec
from hotpool.billing.models import STATUSES
from hotpool.billing.scale_events import ScaleEventRecord, ScaleEventStore
from hotpool.billing.tenants import TenantStore
from hotpool.billing.usage_stats import (
    DeploymentStats,
    VersionStats,
    deployment_stats,
    version_stats,
)
from hotpool.platform.auth import Authenticator, authorize
from hotpool.platform.deployments_api import event_json
from hotpool.platform.errors import invalid
from hotpool.platform.services import Services
from hotpool.platform.spec_stats import SpecStats
from hotpool.platform.usage_api import EPOCH, tenant_filter, time_param
from hotpool.pool.replica import ReplicaState

SUMMARY_PARAMS = {"start_time", "end_time", "tenant"}
DEFAULT_RANGE = timedelta(hours=24)
MAX_RANGE = timedelta(days=366)
# A month of a flapping deployment must not make the page slow: the latest ones are kept.
MAX_SCALE_EVENTS = 2000


def _ts(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


async def get_me(request: Request) -> Response:
    """The caller's tenant and key; any valid key may ask (no scope needed)."""
    services: Services = request.app.state.services
    auth: Authenticator = services.auth
    principal = await auth.principal(request)
    tenant = await asyncio.to_thread(services.tenants.get, principal.tenant_id)
    key = principal.key
    return JSONResponse(
        {
            "object": "principal",
            "auth": "keys" if key else "off",
            "tenant": {"id": principal.tenant_id, "name": tenant.name if tenant else None},
            "key": None
            if key is None
            else {"prefix": key.prefix, "name": key.name, "scopes": sorted(key.scopes)},
            "admin": principal.is_admin,
            "operator": principal.is_operator,  # sees every tenant
        }
    )


@dataclass(frozen=True)
class _Ledger:
    stats: list[DeploymentStats]
    events: list[ScaleEventRecord]
    truncated: bool
    tenants: dict[int, str]
    versions: dict[str, list[VersionStats]]  # deployments with a canary: per version


def _read(
    db: Database, start: datetime, end: datetime, tenant: int | None, canaries: list[str]
) -> _Ledger:
    """Everything the summary reads from SQL, in one worker thread."""
    stats = deployment_stats(db, start, end, tenant_id=tenant)
    versions = {
        name: version_stats(db, start, end, deployment=name, tenant_id=tenant) for name in canaries
    }
    events = ScaleEventStore(db).between(start, end, tenant_id=tenant, limit=MAX_SCALE_EVENTS + 1)
    truncated = len(events) > MAX_SCALE_EVENTS
    names = {t.id: t.name for t in TenantStore(db).list()}
    return _Ledger(stats, events[-MAX_SCALE_EVENTS:], truncated, names, versions)


async def get_summary(request: Request) -> Response:
    principal = await authorize(request, "usage")
    services: Services = request.app.state.services
    unknown = sorted(set(request.query_params) - SUMMARY_PARAMS)
    if unknown:
        raise invalid(f"unknown query parameter `{unknown[0]}`", unknown[0])
    end = time_param(request, "end_time") or datetime.now(UTC)
    start = time_param(request, "start_time") or max(end - DEFAULT_RANGE, EPOCH)
    if start >= end:
        raise invalid("`start_time` must be before `end_time`", "start_time")
    if end - start > MAX_RANGE:
        raise invalid(f"the range may span at most {MAX_RANGE.days} days", "start_time")
    tenant = await tenant_filter(request, principal)
    # Deployments that exist now, with their live replicas, and those the ledger knows.
    specs = {
        name: spec
        for name, spec in services.catalog.all().items()
        if tenant is None or spec.tenant_id == tenant
    }
    canaries = sorted(n for n, s in specs.items() if s.canary_version is not None)
    ledger = await asyncio.to_thread(_read, services.db, start, end, tenant, canaries)

    replicas: dict[str, Counter[str]] = {}
    states_by_version: dict[str, Counter[int]] = {name: Counter() for name in specs}
    for r in services.pool.replicas():
        if r.deployment in specs:
            replicas.setdefault(r.deployment, Counter())[r.state.value] += 1
            states_by_version[r.deployment][r.generation] += 1
    stats = {s.deployment: s for s in ledger.stats}
    # Over the replicas live and gone: a deployment scaled to zero keeps its acceptance rate.
    spec_stats = services.spec_tally.stats(services.pool, services.catalog.all())
    deployments = []
    for name in sorted(set(specs) | set(stats)):
        spec, s = specs.get(name), stats.get(name)
        states = replicas.get(name, Counter())
        deployments.append(
            {
                "name": name,
                "tenant": ledger.tenants.get(spec.tenant_id) if spec else None,
                "live": spec is not None,
                "min_replicas": spec.min_replicas if spec else None,
                "max_replicas": spec.max_replicas if spec else None,
                "quantization": spec.quantization if spec else None,
                "speculation": _speculation_json(spec, spec_stats.get(name)),
                "replicas": {state.value: states[state.value] for state in ReplicaState},
                "requests": s.requests if s else dict.fromkeys(STATUSES, 0),
                "ttft_seconds": {"p50": s.ttft_p50 if s else None,
                                 "p95": s.ttft_p95 if s else None},
                "total_seconds": {"p50": s.total_p50 if s else None,
                                  "p95": s.total_p95 if s else None},
                "last_request_at": _ts(s.last_request_at if s else None),
                "version": spec.generation if spec else None,
                "canary": None if spec is None or spec.canary_version is None
                else {"version": spec.canary_version, "percent": spec.canary_percent},
                "versions": _versions_json(spec, ledger.versions[name], states_by_version[name])
                if spec is not None and name in ledger.versions else None,
            }
        )  # fmt: skip
    totals = dict.fromkeys(STATUSES, 0)
    for s in ledger.stats:
        for status, n in s.requests.items():
            totals[status] += n
    return JSONResponse(
        {
            "object": "usage.summary",
            "start_time": int(start.timestamp()),
            "end_time": int(end.timestamp()),
            "tenant": None if tenant is None else ledger.tenants.get(tenant),
            "requests": totals,
            "deployments": deployments,
            "scale_events": [event_json(e) for e in ledger.events],
            "scale_events_truncated": ledger.truncated,
        }
    )


def _speculation_json(spec: DeploymentSpec | None, stats: SpecStats | None) -> Any:
    """The deployment's speculative decoding (method, k) with its figures: tokens proposed
    and accepted over its replicas live and gone, and its ready replicas that report (with
    the switch on); None when it does not speculate."""
    if spec is None or spec.speculative is None:
        return None
    policy = json.loads(spec.speculative)
    s = stats or SpecStats()
    return {
        "method": policy["method"],
        "num_tokens": policy["num_tokens"],
        "proposed": s.proposed,
        "accepted": s.accepted,
        "acceptance_rate": s.acceptance_rate,
        "replicas": s.replicas,
        "enabled_replicas": s.enabled_replicas,
    }


def _versions_json(
    spec: DeploymentSpec, stats: list[VersionStats], replicas: Counter[int]
) -> list[dict[str, Any]]:
    """The stable and the canary version side by side (what a canary is judged on), then any
    other version that served requests in the range (one being drained, say)."""
    by_version = {s.version: s for s in stats}
    canary = spec.canary_version
    order = [
        spec.generation,
        canary,
        *sorted(v for v in by_version if v not in (spec.generation, canary) and v is not None),
    ]
    out = []
    for v in order:
        s = by_version.get(v)
        role = "stable" if v == spec.generation else "canary" if v == canary else None
        share = spec.canary_percent or 0.0
        out.append(
            {
                "version": v,
                "role": role,
                "traffic_percent": 100.0 - share if role == "stable" else share if role else 0.0,
                "replicas": replicas.get(v, 0),
                "requests": s.requests if s else dict.fromkeys(STATUSES, 0),
                "input_tokens": s.prompt_tokens if s else 0,
                "input_cached_tokens": s.cached_tokens if s else 0,
                "output_tokens": s.completion_tokens if s else 0,
                "ttft_seconds": {"p50": s.ttft_p50 if s else None,
                                 "p95": s.ttft_p95 if s else None},
                "total_seconds": {"p50": s.total_p50 if s else None,
                                  "p95": s.total_p95 if s else None},
            }
        )  # fmt: skip
    return out


routes = [
    Route("/v1/me", get_me, methods=["GET"]),
    Route("/v1/usage/summary", get_summary, methods=["GET"]),
]
