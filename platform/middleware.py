"""Pure ASGI middleware (no BaseHTTPMiddleware: it buffers streams and breaks cancellation)."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class RequestIdMiddleware:
    """Every response carries a fresh ``x-request-id``, also kept in ``scope["state"]``.

    It is the ledger's key for the request. It is always minted here, never taken from the
    client: a client-chosen id would let one request be billed in place of another.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
            await send(message)

        await self.app(scope, receive, send_with_id)
