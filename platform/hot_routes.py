"""The invocation routes' short way through the control plane.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are nearly every request the
control plane serves, and in a burst each one waits for the admission of those ahead of it
before its own reaches a worker. Starlette's stack in front of a handler (error middleware,
exception middleware, router, ``request_response``) wraps every ``send`` of the response
two times more and cost such a request ~25 us of the ~45 us that the ASGI layers took in
all (17 sends, measured in-process); ``benchmarks/bench_gateway.py`` at c=32, with the lane
switched on and off within one run, showed the gateway's TTFT p50 1.0-1.4 ms lower with
it. None of it buys these routes anything: their handlers report
every client error as an :class:`~hotpool.platform.errors.APIError`, which this lane answers
as the app's exception handlers would, and anything else unexpected reaches the same
:class:`~hotpool.platform.middleware.RequestIdMiddleware` that answers it elsewhere (the
OpenAI-shaped 500 with the request's ids). Every other request, and these paths with any
other method (405 with ``Allow``), go through Starlette unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from hotpool.platform.errors import APIError, http_exception_handler
from hotpool.platform.middleware import RequestIdMiddleware

Endpoint = Callable[[Request], Awaitable[Response]]


class ControlPlaneApp(Starlette):
    """Starlette, with ``hot`` (path -> handler of its ``POST``) served past its stack."""

    def __init__(self, *, hot: Mapping[str, Endpoint], auth_off: bool, **kw: Any) -> None:
        super().__init__(**kw)
        self._hot = dict(hot)
        self._lane = RequestIdMiddleware(self._serve_hot, auth_off=auth_off)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in self._hot
            and not scope.get("root_path")  # mounted under a prefix: Starlette's routing
        ):
            scope["app"] = self  # what Starlette sets: handlers find the services there
            await self._lane(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def _serve_hot(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self._hot[scope["path"]](request)
        except APIError as exc:
            response = exc.response()
        except HTTPException as exc:
            response = await http_exception_handler(request, exc)
        await response(scope, receive, send)
