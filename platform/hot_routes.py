"""The invocation routes' short way through the control plane.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are nearly every request the
control plane serves, and in a burst each one waits for the admission of those ahead of it
before its own reaches a worker. Starlette's stack in front of a handler (error middleware,
exception middleware, router, ``request_response``) wraps every ``send`` of the response
two times more and cost such a request ~25 us of the ~45 us that the ASGI layers took in
all (17 sends, measured in-process); ``benchmarks/bench_gateway.py`` at c=32, with the lane
switched on and off within one run, showed the gateway's TTFT p50 1.0-1.4 ms lower with
it. The lane keeps what those routes use: the app's own middleware (``middleware=``:
:class:`~hotpool.platform.middleware.RequestIdMiddleware`, which also answers an unexpected
error with the OpenAI-shaped 500 and the request's ids) and its exception handlers (an
:class:`~hotpool.platform.errors.APIError` answered as anywhere else). Every other request,
and these paths with any other method (405 with ``Allow``), go through Starlette unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


class ControlPlaneApp(Starlette):
    """Starlette, with ``hot`` (path -> handler of its ``POST``) served past its routing."""

    def __init__(self, *, hot: Mapping[str, Endpoint], **kw: Any) -> None:
        super().__init__(**kw)
        # A body limit of Starlette's own (1.x's max_body_size) is its stack's: no lane then.
        self._hot = {} if getattr(self, "max_body_size", None) is not None else dict(hot)
        self._lane: ASGIApp | None = None  # built on first use, as Starlette builds its stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in self._hot
            and not scope.get("root_path")  # mounted under a prefix: Starlette's routing
        ):
            scope["app"] = self  # what Starlette sets: handlers find the services there
            if self._lane is None:
                self._lane = self._build_lane()
            await self._lane(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def _build_lane(self) -> ASGIApp:
        app: ASGIApp = self._serve_hot
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return app

    async def _serve_hot(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self._hot[scope["path"]](request)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise  # the app's middleware answers it (a 500), as Starlette's would
            answer = handler(request, exc)
            response = await answer if inspect.isawaitable(answer) else answer
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Callable[..., Any] | None:
        """The app's handler of ``exc``, as Starlette's exception middleware finds it: by
        status code for an ``HTTPException``, else by class; ``Exception`` and 500 are not
        its (Starlette gives them to its error middleware)."""
        handlers = self.exception_handlers
        if isinstance(exc, HTTPException) and exc.status_code in handlers:
            return handlers[exc.status_code]
        for cls in type(exc).__mro__:
            if cls is Exception:
                return None
            if cls in handlers:
                return handlers[cls]
        return None
