"""``/dashboard``: the token-usage web page, served from files inside the package.

The page is static; it signs in with an API key (kept in the browser's session storage)
and draws from the JSON APIs (``/v1/me``, ``/v1/usage``, ``/v1/usage/summary``,
``/v1/tenants`` for admins). Only the files listed here are served, so no path a client
sends ever reaches the file system. Chart.js is vendored with its licence: the page works
with no internet. A strict Content-Security-Policy allows scripts from this server only.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from hotpool.platform.errors import APIError

ROOT = Path(__file__).parent / "dashboard"
# URL name -> (file under ROOT, media type)
FILES = {
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "chart.umd.min.js": ("vendor/chart.umd.min.js", "text/javascript; charset=utf-8"),
    "chart.js-LICENSE.md": ("vendor/chart.js-LICENSE.md", "text/markdown; charset=utf-8"),
}
HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    # The files change only with a release; a short cache keeps reloads cheap.
    "cache-control": "public, max-age=300",
}


@cache
def _read(name: str) -> bytes:
    return (ROOT / name).read_bytes()


async def page(_: Request) -> Response:
    return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers=HEADERS)


async def asset(request: Request) -> Response:
    name = request.path_params["file"]
    if name not in FILES:
        raise APIError(404, f"no dashboard file named {name!r}", code="not_found")
    path, media_type = FILES[name]
    return Response(_read(path), media_type=media_type, headers=HEADERS)


routes = [
    Route("/dashboard", page, methods=["GET"]),
    Route("/dashboard/{file}", asset, methods=["GET"]),
]
