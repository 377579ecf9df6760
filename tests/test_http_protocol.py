"""hotpool.http_protocol: uvicorn's HTTP protocol with the writes of one loop pass joined."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send
from uvicorn_thread import uvicorn_in_thread

from hotpool.http_protocol import (
    CorkedHttpToolsProtocol,
    CorkedTransport,
    HeadCorkedHttpToolsProtocol,
)
from hotpool.streaming import ChunkStream, Last


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1234) if name == "peername" else None


def test_writes_of_one_loop_pass_leave_in_one_write_and_close_flushes_first() -> None:
    async def run() -> FakeTransport:
        fake = FakeTransport()
        corked = CorkedTransport(fake, asyncio.get_running_loop())  # type: ignore[arg-type]
        corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
        corked.write(b"5\r\nhello\r\n")
        assert fake.writes == [] and corked.get_write_buffer_size() == 29
        await asyncio.sleep(0)  # the end of the pass
        assert fake.writes == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n"]
        corked.write(b"0\r\n\r\n")
        corked.close()  # nothing written is lost behind the close
        assert fake.writes[-1] == b"0\r\n\r\n" and fake.closed
        assert corked.get_extra_info("peername") == ("127.0.0.1", 1234)  # the rest: as is
        await asyncio.sleep(0)
        assert len(fake.writes) == 2  # the scheduled flush found nothing left
        return fake

    asyncio.run(run())


def test_head_corked_a_head_leaves_with_its_first_body_and_bodies_leave_at_once() -> None:
    """The control plane's kind: a stream's head and first chunk in one write, and each
    chunk of a fan-out written as soon as it is made, not at the end of the pass."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = FakeTransport(), FakeTransport()
        ca = CorkedTransport(a, loop, whole_pass=False)  # type: ignore[arg-type]
        cb = CorkedTransport(b, loop, whole_pass=False)  # type: ignore[arg-type]
        ca.write(b"HTTP/1.1 200 OK\r\n\r\n")
        assert a.writes == [] and ca.get_write_buffer_size() == 19
        ca.write(b"5\r\nhello\r\n")
        assert a.writes == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n"]  # one write, now
        cb.write(b"HTTP/1.1 200 OK\r\n\r\n")
        cb.write(b"2\r\nhi\r\n")
        ca.write(b"1\r\n!\r\n")
        assert a.writes[-1] == b"1\r\n!\r\n" and len(b.writes) == 1  # in the same pass
        cb.write(b"HTTP/1.1 204 No Content\r\n\r\n")  # a head with no body
        await asyncio.sleep(0)  # leaves at the end of the pass
        assert b.writes[-1] == b"HTTP/1.1 204 No Content\r\n\r\n" and len(a.writes) == 2

    asyncio.run(run())


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    n = int(scope["path"].strip("/") or 0)

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(n):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.001)
        yield Last(b"data: [DONE]\n\n")

    await ChunkStream(chunks(), "text/event-stream")(scope, receive, send)


PROTOCOLS = pytest.mark.parametrize(
    "protocol", [CorkedHttpToolsProtocol, HeadCorkedHttpToolsProtocol], ids=["pass", "head"]
)


@PROTOCOLS
def test_streams_over_one_kept_alive_connection_keep_their_framing(protocol: type) -> None:
    with (
        uvicorn_in_thread(_app, http=protocol) as url,
        httpx.Client(base_url=url) as client,
    ):
        for n in (0, 1, 5, 20):
            with client.stream("POST", f"/{n}") as r:
                parts = list(r.iter_text())
            body = "".join(parts)
            assert body == "".join(f"data: {i}\n\n" for i in range(n)) + "data: [DONE]\n\n"
        # every request reused the first connection: the framing never went out of step
        pool = client._transport._pool  # type: ignore[attr-defined]
        assert len(pool.connections) == 1


@PROTOCOLS
def test_a_connection_close_request_gets_its_whole_body(protocol: type) -> None:
    with uvicorn_in_thread(_app, http=protocol) as url:
        r = httpx.post(f"{url}/3", headers={"connection": "close"})
        assert r.status_code == 200
        assert r.text == "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
