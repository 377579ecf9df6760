"""The control plane's parts, built once at start-up and shared by every route."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
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
from hotpool.platform.schema_checks import SchemaChecker
from hotpool.platform.spec_stats import SpecTally
from hotpool.pool.autoscaler import Autoscaler
from hotpool.pool.pool import WorkerPool
from hotpool.pool.registry import WorkerRegistry
from hotpool.settings import Settings

MAX_BODY_BYTES = 8 * 1024 * 1024
# JSON can spell a UTF-16 surrogate as an escape (UTF-8 text cannot hold one): only a body
# with such an escape can decode to a string holding an unpaired one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


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
    schemas: SchemaChecker
    # Speculation's counts over replicas live and gone (fed by heartbeats, read by the dashboard).
    spec_tally: SpecTally = field(default_factory=SpecTally)

    def begin_shutdown(self) -> None:
        """A graceful stop begins (before the listener closes): running streams go on, but
        workers are no longer judged by heartbeats, which cannot arrive, nothing is scaled,
        and requests waiting for a replica are answered 503 at once."""
        self.pool.begin_shutdown()
        self.router.begin_shutdown()


async def read_body(request: Request) -> bytes:
    """The request body, or a 413 as soon as it is over MAX_BODY_BYTES: a declared length
    over it is refused before a byte is read, and a chunked body is counted as it comes
    (read whole first, one upload of gigabytes held them all in memory before the check)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # as Request.body() keeps it, for whoever asks again
    return body


def _too_large() -> APIError:
    return APIError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")


async def read_json(request: Request) -> Any:
    """The request body as JSON, or a 400 that says what is wrong with it."""
    body = await read_body(request)
    if not body:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        # UTF-8 strictly (RFC 8259): json.loads(bytes) would also take UTF-16/32 and the
        # bytes of a lone surrogate, which no string check below could then tell from text.
        value = json.loads(body.decode("utf-8"))
    # ValueError also covers an integer of more than 4300 digits; RecursionError, nesting
    # too deep for the parser. Both are the client's bad input, not a server error.
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(body) and (where := unpaired_surrogate(value)) is not None:
        # Python's json module accepts "\ud800" alone, but such a string is not Unicode text:
        # it cannot be encoded, stored, tokenized or echoed in an error message.
        raise APIError(
            400,
            f"{where or 'the request body'} holds an unpaired UTF-16 surrogate escape "
            "(\\ud800-\\udfff without its pair), which is not a character",
            param=where or None,
        )
    return value


def unpaired_surrogate(value: Any) -> str | None:
    """Where in decoded JSON a string (a value or a key) holds an unpaired surrogate: a path
    like ``messages[0].content`` ("" for the top level), or None. Iterative: the body may
    nest as deep as the parser allows."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _unencodable(v):
                return path
        elif isinstance(v, dict):
            for key, item in v.items():
                inner = f"{path}.{key}" if path else key
                if _unencodable(key):
                    return path
                stack.append((inner, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


def _unencodable(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode()
    except UnicodeEncodeError:
        return True
    return False
