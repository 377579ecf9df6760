"""The control plane's parts, built once at start-up and shared by every route."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore
from hotpool.billing.ledger import Ledger
from hotpool.billing.tenants import TenantStore
from hotpool.platform.auth import Authenticator
from hotpool.platform.catalog import DeploymentCatalog
from hotpool.platform.errors import APIError
from hotpool.platform.invoke import Invoker
from hotpool.platform.ledger_writer import LedgerWriter
from hotpool.platform.metrics import Metrics
from hotpool.platform.router import Router
from hotpool.platform.scale_log import ScaleEventWriter
from hotpool.pool.autoscaler import Autoscaler
from hotpool.pool.pool import WorkerPool
from hotpool.pool.registry import WorkerRegistry
from hotpool.settings import Settings

MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass
class Services:
    settings: Settings
    db: Database
    ledger: Ledger
    catalog: DeploymentCatalog
    registry: WorkerRegistry
    pool: WorkerPool
    router: Router
    ledger_writer: LedgerWriter
    scale_events: ScaleEventWriter
    invoker: Invoker
    autoscaler: Autoscaler
    metrics: Metrics
    worker_token: str
    auth: Authenticator
    tenants: TenantStore
    keys: KeyStore


async def read_json(request: Request) -> Any:
    """The request body as JSON, or a 400 that says what is wrong with it."""
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
    if not body:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        return json.loads(body)
    # ValueError also covers an integer of more than 4300 digits; RecursionError, nesting
    # too deep for the parser. Both are the client's bad input, not a server error.
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
