"""The CLI's API calls carry ``HOTPOOL_API_KEY``: a server that requires keys answers them
(a real HTTP server in a thread that checks the key as hotpool's does)."""

from __future__ import annotations

import click
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from uvicorn_thread import uvicorn_in_thread

from hotpool.cli_common import call_api

KEY = "hp_" + "k" * 40


async def usage(request: Request) -> JSONResponse:
    if request.headers.get("authorization") != f"Bearer {KEY}":
        return JSONResponse({"error": {"message": "You didn't provide an API key."}}, 401)
    return JSONResponse({"object": "list", "data": []})


APP = Starlette(routes=[Route("/v1/usage", usage)])


def test_the_key_in_the_environment_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    with uvicorn_in_thread(APP) as url:
        monkeypatch.delenv("HOTPOOL_API_KEY", raising=False)
        with pytest.raises(click.ClickException) as err:
            call_api("GET", f"{url}/v1/usage")
        assert "401" in err.value.message and "set HOTPOOL_API_KEY" in err.value.message
        monkeypatch.setenv("HOTPOOL_API_KEY", KEY)
        assert call_api("GET", f"{url}/v1/usage") == {"object": "list", "data": []}
        monkeypatch.setenv("HOTPOOL_API_KEY", "hp_wrong")
        with pytest.raises(click.ClickException) as err:
            call_api("GET", f"{url}/v1/usage")
        assert "401" in err.value.message and "set HOTPOOL_API_KEY" not in err.value.message
