"""``/v1/prices``: what tokens cost, set and read by an ``admin`` key.

Amounts are integers: micro-units of the currency per million tokens (``"input": 150000``
is $0.15 per 1M input tokens; ``cached_input`` prices prompt tokens served from the prefix
cache). Integers only, never decimals, in JSON: a JSON number read as a float cannot hold
every price exactly. A price without ``deployment`` (or with null) is the default of every
deployment that has none of its own. ``effective_from`` is a Unix time in seconds (default:
now); a price applies to requests from then until the next one, and a request's cost is
fixed when it is recorded.
"""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.billing.prices import (
    DEFAULT_CURRENCY,
    MAX_PRICE_MICROS,
    CurrencyMismatch,
    PriceExists,
    PriceRecord,
    PriceStore,
    check_deployment,
)
from hotpool.platform.auth import authorize
from hotpool.platform.errors import APIError, invalid, json_object
from hotpool.platform.services import Services, read_json
from hotpool.platform.usage_api import MAX_TIMESTAMP

AMOUNTS = ("input", "cached_input", "output")
FIELDS = {"deployment", "currency", "effective_from", *AMOUNTS}


def price_json(p: PriceRecord) -> dict[str, Any]:
    return {
        "object": "price",
        "id": p.id,
        "deployment": p.deployment,
        "currency": p.currency,
        "input": p.input,
        "cached_input": p.cached_input,
        "output": p.output,
        "effective_from": int(p.effective_from.timestamp()),
        "created_at": int(p.created_at.timestamp()) if p.created_at else None,
    }


def _deployment(name: Any) -> str:
    try:
        return check_deployment(name)
    except ValueError as exc:
        raise invalid(f"`deployment`: {exc}", "deployment") from None


def _amount(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRICE_MICROS:
        raise invalid(
            f"`{name}` must be an integer number of micro-units per million tokens from 0 to"
            f" {MAX_PRICE_MICROS} (150000 is 0.15 per 1M tokens)",
            name,
        )
    return value


def parse_price(body: Any) -> PriceRecord:
    """The price a ``POST /v1/prices`` body asks for, or a 400 naming the bad field."""
    body = json_object(body, FIELDS)
    deployment = body.get("deployment")
    if deployment is not None:
        deployment = _deployment(deployment)
    currency = body.get("currency", DEFAULT_CURRENCY)
    if not isinstance(currency, str) or not re.fullmatch(r"[A-Z]{3}", currency):
        raise invalid("`currency` must be an ISO 4217 code of 3 capital letters", "currency")
    effective_from = body.get("effective_from")
    if effective_from is None:
        at = datetime.now(UTC)
    elif (
        isinstance(effective_from, bool)
        or not isinstance(effective_from, int)
        or not 0 <= effective_from < MAX_TIMESTAMP
    ):
        raise invalid(
            f"`effective_from` must be a Unix time in seconds from 0 to {MAX_TIMESTAMP}",
            "effective_from",
        )
    else:
        at = datetime.fromtimestamp(effective_from, UTC)
    amounts = {name: _amount(body, name) for name in AMOUNTS}
    return PriceRecord(deployment, effective_from=at, currency=currency, **amounts)


async def create_price(request: Request) -> Response:
    await authorize(request, "admin")
    services: Services = request.app.state.services
    price = parse_price(await read_json(request))
    store = PriceStore(services.db)
    try:
        created = await asyncio.to_thread(
            store.set,
            price.deployment,
            price.input,
            price.cached_input,
            price.output,
            price.effective_from,
            price.currency,
        )
    except PriceExists as exc:
        raise APIError(409, str(exc), param="effective_from", code="price_exists") from None
    except CurrencyMismatch as exc:
        raise APIError(409, str(exc), param="currency", code="currency_mismatch") from None
    return JSONResponse(price_json(created), status_code=201)


async def list_prices(request: Request) -> Response:
    await authorize(request, "admin")
    services: Services = request.app.state.services
    unknown = sorted(set(request.query_params) - {"deployment"})
    if unknown:
        raise invalid(f"unknown query parameter `{unknown[0]}`", unknown[0])
    deployment = request.query_params.get("deployment")
    if deployment is not None:
        deployment = _deployment(deployment)
    prices = await asyncio.to_thread(PriceStore(services.db).list, deployment)
    return JSONResponse({"object": "list", "data": [price_json(p) for p in prices]})


routes = [
    Route("/v1/prices", create_price, methods=["POST"]),
    Route("/v1/prices", list_prices, methods=["GET"]),
]
