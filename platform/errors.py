"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every 4xx/5xx."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match

log = logging.getLogger("hotpool.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error a client should see as is; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "api_error")
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = (
            {"retry-after": str(self.retry_after_s)} if self.retry_after_s is not None else None
        )
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def json_object(body: Any, allowed: Iterable[str]) -> dict[str, Any]:
    """``body`` if it is a JSON object with only ``allowed`` fields, else a 400 naming the
    first unknown one (unknown fields are refused, never silently ignored)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise invalid(f"unknown field `{unknown[0]}`", unknown[0])
    return body


async def api_error_handler(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {
        404: f"no route for {request.method} {request.url.path}",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, str(exc.detail))
    response = APIError(exc.status_code, message).response()
    if exc.status_code == 405:  # HTTP requires the methods the resource does allow
        response.headers["allow"] = ", ".join(_allowed_methods(request))
    return response


def _allowed_methods(request: Request) -> list[str]:
    # Every route of the path, not only the one Starlette matched first: GET and POST of
    # /v1/deployments are two routes.
    methods: set[str] = set()
    for route in getattr(request.app, "routes", ()):
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


async def database_error_handler(request: Request, exc: Exception) -> Response:
    """The database could not be reached or lost the connection: the client may retry, and
    nothing about it is a bug in hotpool (the statement's text stays in the log)."""
    log.warning(
        "the database did not answer %s %s: %s", request.method, request.url.path,
        str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
    )  # fmt: skip
    return APIError(
        503, "the database is not answering; retry shortly", code="database_unavailable",
        retry_after_s=5,
    ).response()  # fmt: skip


async def client_disconnect_handler(request: Request, _: Exception) -> Response:
    """The client went away while its request body was being read: nobody is left to
    answer, and it is no error of the server's. 499, as nginx logs it."""
    log.info("client disconnected during the request body of %s %s", request.method,
             request.url.path)  # fmt: skip
    return Response(status_code=499)


async def unhandled_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(
        500, "internal server error; this is a bug in hotpool", type="api_error"
    ).response()


EXCEPTION_HANDLERS = {
    APIError: api_error_handler,
    HTTPException: http_exception_handler,
    # Connection-level failures only: a constraint violation (IntegrityError) or a bad
    # statement (ProgrammingError) is a bug, and stays a 500.
    OperationalError: database_error_handler,
    InterfaceError: database_error_handler,
    ClientDisconnect: client_disconnect_handler,
    Exception: unhandled_error_handler,
}
