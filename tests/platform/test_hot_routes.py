"""hotpool.platform.hot_routes: the invocations' lane past Starlette's routing stack keeps
the app's middleware and exception handlers, and everything else goes through Starlette."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotpool.platform.errors import EXCEPTION_HANDLERS, APIError
from hotpool.platform.hot_routes import ControlPlaneApp
from hotpool.platform.middleware import RequestIdMiddleware


class Tag:
    """A middleware of the app's: every response it passes carries ``x-tag``."""

    def __init__(self, app: ASGIApp, value: bytes) -> None:
        self.app, self.value = app, value

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-tag", self.value)]
            await send(message)

        await self.app(scope, receive, tagged)


class Teapot(Exception):
    pass


async def teapot(_: Request, __: Exception) -> Response:
    return JSONResponse({"teapot": True}, status_code=418)


async def invoke(request: Request) -> Response:
    fail = (await request.json()).get("fail")
    if fail == "api":
        raise APIError(400, "bad temperature", param="temperature")
    if fail == "teapot":
        raise Teapot()
    if fail == "bug":
        raise RuntimeError("a bug")
    return JSONResponse({"ok": True, "app": type(request.app).__name__})


async def cold(_: Request) -> Response:
    return JSONResponse({"cold": True})


@pytest.fixture
def app() -> ControlPlaneApp:
    return ControlPlaneApp(
        hot={"/invoke": invoke},
        routes=[Route("/invoke", invoke, methods=["POST"]), Route("/cold", cold)],
        middleware=[Middleware(Tag, b"1"), Middleware(RequestIdMiddleware)],
        exception_handlers={**EXCEPTION_HANDLERS, Teapot: teapot},  # type: ignore[dict-item]
    )


def _past_starlette(app: ControlPlaneApp) -> None:
    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("went through Starlette's stack")

    app.middleware_stack = refuse


@pytest.mark.parametrize(
    ("body", "status", "check"),
    [
        ({}, 200, {"ok": True, "app": "ControlPlaneApp"}),
        ({"fail": "api"}, 400, {"message": "bad temperature", "param": "temperature"}),
        ({"fail": "teapot"}, 418, {"teapot": True}),  # the app's own handler
        ({"fail": "bug"}, 500, {"type": "api_error"}),  # RequestIdMiddleware's answer
    ],
)
def test_a_hot_route_keeps_the_apps_middleware_and_exception_handlers(
    app: ControlPlaneApp, body: dict[str, Any], status: int, check: dict[str, Any]
) -> None:
    client = TestClient(app, raise_server_exceptions=False)
    client.get("/cold")  # Starlette builds its stack; the lane must not need it
    _past_starlette(app)
    r = client.post("/invoke", json=body)
    assert r.status_code == status, r.text
    got = r.json().get("error", r.json())
    assert {k: got.get(k) for k in check} == check
    assert r.headers["x-tag"] == "1" and r.headers["x-request-id"].startswith("req_")


def test_other_methods_and_paths_go_through_starlette(app: ControlPlaneApp) -> None:
    client = TestClient(app, raise_server_exceptions=False)
    r = client.get("/invoke")
    assert r.status_code == 405 and r.headers["allow"] == "POST"  # Starlette's routing
    assert r.headers["x-tag"] == "1"
    assert client.get("/cold").json() == {"cold": True}
    _past_starlette(app)
    assert client.get("/cold").status_code == 500  # it did go through the stack
    assert client.post("/invoke", json={}).status_code == 200  # and this did not
