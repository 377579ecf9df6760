"""Pure ASGI middleware (no BaseHTTPMiddleware: it buffers streams and breaks cancellation)."""

from __future__ import annotations

import logging
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotpool.platform.errors import APIError

log = logging.getLogger("hotpool.api")


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class RequestIdMiddleware:
    """Every response carries a fresh ``x-request-id``, also kept in ``scope["state"]``.

    It is the ledger's key for the request. It is always minted here, never taken from the
    client: a client-chosen id would let one request be billed in place of another. An
    unhandled error becomes the OpenAI-shaped 500 here, so that response carries the id too
    (Starlette's own error middleware sits outside this one).
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
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                    *self.extra,
                ]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception(
                "unhandled error in %s %s (%s)", scope["method"], scope["path"], request_id
            )
            if started:
                raise  # mid-stream: nothing sane can be sent any more
            body = APIError(
                500, "internal server error; this is a bug in hotpool", type="api_error"
            )
            await body.response()(scope, receive, send_with_id)
