"""Pure ASGI middleware (no BaseHTTPMiddleware: it buffers streams and breaks cancellation)."""

from __future__ import annotations

import logging
import re
import time
from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotpool.http_protocol import new_request_id
from hotpool.platform.errors import APIError

log = logging.getLogger("hotpool.api")
access_log = logging.getLogger("hotpool.access")

# Worker heartbeats every few seconds would drown the access log.
QUIET_PREFIXES = ("/internal/workers/",)


# What a client may send as its own x-request-id: short, printable, no spaces.
CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/+=-]{0,63}$")


class RequestIdMiddleware:
    """Every response carries an ``x-request-id``, kept in ``scope["state"]`` too.

    The ledger's key for a request is always minted here (``x-hotpool-request-id``): a
    client-chosen key would let one request be billed in place of another, or a client
    reuse one id to be billed once. A well-formed ``x-request-id`` from the client is
    accepted for correlation: echoed back, logged and kept in the ledger beside the key;
    without one, ``x-request-id`` is the key. An unhandled error becomes the OpenAI-shaped
    500 here, so that response carries the ids too (Starlette's own error middleware sits
    outside this one).
    """

    def __init__(self, app: ASGIApp, auth_off: bool = False) -> None:
        self.app = app
        # Local-only mode says so on every response, so nobody mistakes it for production.
        self.extra = [(b"x-hotpool-auth", b"off")] if auth_off else []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        client_id = _client_request_id(scope)
        state = scope.setdefault("state", {})
        state["request_id"], state["client_request_id"] = request_id, client_id
        ids = [
            (b"x-request-id", (client_id or request_id).encode()),
            (b"x-hotpool-request-id", request_id.encode()),
            *self.extra,
        ]
        started = False
        status = 0
        t0 = time.monotonic()

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                message["headers"] = [*message.get("headers", []), *ids]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception(
                "unhandled error in %s %s (%s)", scope["method"], quote(scope["path"]), request_id
            )
            if started:
                raise  # mid-stream: nothing sane can be sent any more
            body = APIError(
                500, "internal server error; this is a bug in hotpool", type="api_error"
            )
            await body.response()(scope, receive, send_with_id)
        finally:
            # Once the response is over (a stream's last token included), not when it starts
            # as uvicorn's access log did: that line was written inside the time to first
            # token. It also says how long the request took.
            if not scope["path"].startswith(QUIET_PREFIXES):
                _log_access(scope, status, time.monotonic() - t0, request_id)


def _log_access(scope: Scope, status: int, seconds: float, request_id: str) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    query = scope.get("query_string", b"")
    # The path is percent-decoded: quoted again (as uvicorn's own access log does), a
    # "%0a" in it cannot start a forged line of this log, nor a "%00" write a NUL into it.
    path = quote(scope["path"]) + ("?" + query.decode("latin-1") if query else "")
    access_log.info(
        '%s - "%s %s HTTP/%s" %d %.1fms %s',
        who, scope["method"], path, scope.get("http_version", "1.1"), status, seconds * 1e3,
        request_id,
        extra={"request_id": request_id, "method": scope["method"], "path": scope["path"],
               "status": status, "duration_ms": round(seconds * 1e3, 3)},
    )  # fmt: skip


def _client_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if CLIENT_REQUEST_ID.match(text) else None
    return None
