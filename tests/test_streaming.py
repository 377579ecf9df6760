"""hotpool.streaming.ChunkStream: the token streams' ASGI response.

Driven at the ASGI level (the messages a server gets), and once through a real uvicorn
server to see that the end of the stream reaches the client before the iterator's cleanup.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send
from uvicorn_thread import uvicorn_in_thread

from hotpool.http_protocol import HeadCorkedHttpToolsProtocol
from hotpool.streaming import ChunkStream, Last

SCOPE: Scope = {"type": "http", "method": "POST", "path": "/", "headers": []}


class Client:
    """The server side of one request: what was sent, and a disconnect on demand."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self.streaming = asyncio.Event()  # a body message was sent

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body":
            self.streaming.set()

    def bodies(self) -> list[tuple[bytes, bool]]:
        return [(m["body"], m["more_body"]) for m in self.sent[1:]]


def test_chunks_then_an_empty_end_and_the_headers() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    client = Client()
    response = ChunkStream(chunks(), "text/event-stream", {"X-Hotpool-Version": "3"}, 201)
    asyncio.run(response(SCOPE, client.receive, client.send))
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 201
    assert (b"content-type", b"text/event-stream") in start["headers"]
    assert (b"x-hotpool-version", b"3") in start["headers"]
    assert client.bodies() == [(b"a", True), (b"b", True), (b"", False)]


def test_last_ends_the_response_before_the_iterator_cleans_up() -> None:
    seen_at_cleanup: list[int] = []
    client = Client()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield Last(b"data: [DONE]\n\n")
        seen_at_cleanup.append(len(client.sent))  # the bookkeeping after the end
        yield b"dropped: the response is over"

    asyncio.run(ChunkStream(chunks(), "text/event-stream")(SCOPE, client.receive, client.send))
    # One message (one write) holds the final data and the end of the body.
    assert client.bodies() == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", False)]
    assert seen_at_cleanup == [3]  # start + two bodies were out before the cleanup ran


def test_a_client_that_goes_away_closes_the_iterator_quietly() -> None:
    closed = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield b"first"
            await asyncio.sleep(3600)  # waiting for a token that never comes
            yield b"never"
        finally:
            closed.set()

    async def run() -> None:
        client = Client()
        task = asyncio.create_task(
            ChunkStream(chunks(), "application/x-ndjson")(SCOPE, client.receive, client.send)
        )
        await client.streaming.wait()
        client.gone.set()
        await asyncio.wait_for(task, 5)  # returns: no CancelledError escapes to the server
        assert closed.is_set()
        assert not task.cancelled() and task.exception() is None
        assert client.bodies() == [(b"first", True)]

    asyncio.run(run())


def test_a_disconnect_after_the_end_does_not_interrupt_the_cleanup() -> None:
    cleaned = asyncio.Event()

    async def run() -> None:
        client = Client()

        async def chunks() -> AsyncIterator[bytes]:
            yield Last(b"all of it")
            client.gone.set()  # uvicorn answers receive() with a disconnect once it is over
            await asyncio.sleep(0.05)  # e.g. draining the worker's stream, then accounting
            cleaned.set()

        await ChunkStream(chunks(), "text/plain")(SCOPE, client.receive, client.send)
        assert cleaned.is_set()

    asyncio.run(run())


def test_a_cancellation_that_is_not_a_disconnect_propagates() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"x"
        await asyncio.sleep(3600)
        yield b"y"

    async def run() -> None:
        client = Client()
        task = asyncio.create_task(
            ChunkStream(chunks(), "text/plain")(SCOPE, client.receive, client.send)
        )
        await client.streaming.wait()
        task.cancel()  # the server shutting down, say
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_an_error_in_the_iterator_reaches_the_server() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"x"
        raise RuntimeError("boom")

    client = Client()
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(ChunkStream(chunks(), "text/plain")(SCOPE, client.receive, client.send))


# -- through uvicorn ---------------------------------------------------------------------


@pytest.mark.parametrize("blocking", [False, True], ids=["awaiting", "blocking"])
@pytest.mark.parametrize(
    "protocol",
    [None, HeadCorkedHttpToolsProtocol],
    ids=["uvicorn", "head-corked"],
)
def test_over_http_the_client_has_the_whole_body_before_the_cleanup_ends(
    protocol: type | None, blocking: bool
) -> None:
    # The servers hold a response's head (hotpool.http_protocol), and a request's accounting
    # after the end of its stream (ledger, metrics, a log line) may run without awaiting:
    # the end must leave before it.
    cleanup_s = 0.5

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            yield Last(b"data: [DONE]\n\n")
            if blocking:
                time.sleep(cleanup_s)  # noqa: ASYNC251 -- work that never yields to the loop
            else:
                await asyncio.sleep(cleanup_s)  # slow bookkeeping after the end

        await ChunkStream(chunks(), "text/event-stream")(scope, receive, send)

    config = {"http": protocol} if protocol is not None else {}
    with uvicorn_in_thread(app, **config) as url, httpx.Client(base_url=url) as client:
        t0 = time.monotonic()
        response = client.post("/")
        took = time.monotonic() - t0
        assert response.status_code == 200
        assert response.text == "data: 1\n\ndata: [DONE]\n\n"
        assert response.headers["transfer-encoding"] == "chunked"
        assert took < cleanup_s  # the response did not wait for the cleanup
