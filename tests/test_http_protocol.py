"""hotpool.http_protocol: uvicorn's HTTP protocol with each response head held for its body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.server import ServerState
from uvicorn_thread import uvicorn_in_thread

from hotpool.http_protocol import MAX_HEAD_BYTES, CorkedTransport, HeadCorkedHttpToolsProtocol
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

    def pause_reading(self) -> None:  # uvicorn's flow control, past 64 KiB of unread body
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1234) if name == "peername" else None


def test_a_held_head_leaves_before_the_close_and_the_rest_is_the_transports() -> None:
    async def run() -> None:
        fake = FakeTransport()
        corked = CorkedTransport(fake, asyncio.get_running_loop())  # type: ignore[arg-type]
        corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
        assert fake.writes == [] and corked.get_write_buffer_size() == 19
        corked.close()  # nothing written is lost behind the close
        assert fake.writes == [b"HTTP/1.1 200 OK\r\n\r\n"] and fake.closed
        assert corked.get_extra_info("peername") == ("127.0.0.1", 1234)  # the rest: as is
        await asyncio.sleep(0)
        assert len(fake.writes) == 1  # the scheduled flush found nothing left

    asyncio.run(run())


def test_head_corked_a_head_leaves_with_its_first_body_and_bodies_leave_at_once() -> None:
    """A stream's head and first chunk in one write, and each chunk written as soon as it
    is made, not at the end of the pass: the control plane's fan-out to 32 clients, and the
    frames of the worker's mux, which the control plane relays while the worker encodes
    the next."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = FakeTransport(), FakeTransport()
        ca = CorkedTransport(a, loop)  # type: ignore[arg-type]
        cb = CorkedTransport(b, loop)  # type: ignore[arg-type]
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


def test_streams_over_one_kept_alive_connection_keep_their_framing() -> None:
    with (
        uvicorn_in_thread(_app, http=HeadCorkedHttpToolsProtocol) as url,
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


def test_a_connection_close_request_gets_its_whole_body() -> None:
    with uvicorn_in_thread(_app, http=HeadCorkedHttpToolsProtocol) as url:
        r = httpx.post(f"{url}/3", headers={"connection": "close"})
        assert r.status_code == 200
        assert r.text == "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


async def _echo(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"%d" % len(body)})


def _raw(url: str, parts: list[bytes], pause_s: float = 0.0) -> bytes:
    """Send ``parts`` on a fresh connection (stopping when the server closes it) and read
    the answer to the end."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        for part in parts:
            try:
                s.sendall(part)
            except OSError:  # the server answered and closed: read what it said
                break
            time.sleep(pause_s)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _error(answer: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)["error"]


def test_client_facing_protocol_answers_bad_requests_and_huge_heads_in_the_api_shape() -> None:
    with uvicorn_in_thread(_echo, http=HeadCorkedHttpToolsProtocol) as url:
        status, headers, error = _error(_raw(url, [b"NOT HTTP AT ALL\r\n\r\n"]))
        assert status == 400 and error["code"] == "invalid_http_request"
        assert error["type"] == "invalid_request_error"
        assert headers["x-request-id"].startswith("req_") and headers["connection"] == "close"

        big = b"x-big: " + b"b" * (MAX_HEAD_BYTES + 1) + b"\r\n"
        # In one read (the head is measured whole) and in many (counted as it comes: the
        # server answers before the client has sent it all, holding at most one read more).
        one = _raw(url, [b"GET / HTTP/1.1\r\nhost: x\r\n" + big + b"\r\n"])
        assert _error(one)[0] == 431 and _error(one)[2]["code"] == "request_headers_too_large"
        drip = [b"GET / HTTP/1.1\r\nhost: x\r\nx-big: "] + [b"b" * 16384] * 200
        assert _error(_raw(url, drip, pause_s=0.002))[0] == 431

        # A head under the bound with a large body behind it (in the same reads): fine, and
        # a kept-alive connection's next request starts a fresh count.
        request = (
            b"POST / HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-h: " + b"h" * 40_000 + b"\r\n"
            b"content-length: 300000\r\n\r\n" + b"y" * 300_000
        )
        with httpx.Client(base_url=url) as client:
            for _ in range(3):
                r = client.post("/", content=b"y" * 300_000, headers={"x-h": "h" * 40_000})
                assert r.status_code == 200 and r.text == "300000"
        answer = _raw(url, [request[:70_000], request[70_000:]])
        assert answer.startswith(b"HTTP/1.1 200") and b"\r\n300000\r\n" in answer


def test_a_huge_head_in_one_read_is_measured_whole() -> None:
    """A head past the bound that arrives in one read (so never counted read by read) is
    refused when it completes, before any request cycle starts."""

    async def run() -> list[bytes]:
        config = uvicorn.Config(_echo, log_level="critical")
        config.load()
        protocol = HeadCorkedHttpToolsProtocol(config, ServerState(), app_state={})
        fake = FakeTransport()
        protocol.connection_made(fake)  # type: ignore[arg-type]
        big = b"x-big: " + b"b" * MAX_HEAD_BYTES + b"\r\n"
        protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n" + big + b"\r\n")
        await asyncio.sleep(0)
        assert fake.closed and not protocol.tasks  # answered, and no app was called
        return fake.writes

    [answer] = asyncio.run(run())
    status, _, error = _error(answer)
    assert status == 431 and error["code"] == "request_headers_too_large"


def test_a_request_whose_head_and_large_body_arrive_in_one_read_is_not_a_huge_head() -> None:
    """The body that shares a read with its head is body: a 71 KB chat request (a head of a
    few hundred bytes) sent in one write was refused as a 431, and kept-alive requests that
    share reads with the next one's head were too."""

    async def run(reads: list[bytes]) -> list[bytes]:
        config = uvicorn.Config(_echo, log_level="critical")
        config.load()
        protocol = HeadCorkedHttpToolsProtocol(config, ServerState(), app_state={})
        fake = FakeTransport()
        protocol.connection_made(fake)  # type: ignore[arg-type]
        for data in reads:
            protocol.data_received(data)
            for _ in range(5):
                await asyncio.sleep(0)
        return fake.writes

    def post(size: int) -> bytes:
        return b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % size + b"y" * size

    for size in (71_000, 1 << 20):
        answer = b"".join(asyncio.run(run([post(size)])))
        assert answer.startswith(b"HTTP/1.1 200") and b"\r\n%d\r\n" % size in answer
    # Three kept-alive requests in one read, then the same bytes split at every 50 KB.
    three = post(40_000) * 3
    for reads in ([three], [three[i : i + 50_000] for i in range(0, len(three), 50_000)]):
        answer = b"".join(asyncio.run(run(reads)))
        assert answer.count(b"HTTP/1.1 200") == 3 and b"431" not in answer


def test_a_71_kb_body_sent_with_its_head_in_one_write_is_served() -> None:
    with uvicorn_in_thread(_echo, http=HeadCorkedHttpToolsProtocol) as url:
        body = b"y" * 71_000
        head = b"POST / HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 71000\r\n\r\n"
        answer = _raw(url, [head + body])
        assert answer.startswith(b"HTTP/1.1 200") and b"\r\n71000\r\n" in answer


def _slow(url: str, parts: list[bytes], pause_s: float) -> tuple[bytes, float]:
    """Send ``parts`` with ``pause_s`` between them (stopping when the server closes the
    connection); the answer, and how long until the server closed it."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.settimeout(pause_s)
        out = b""
        for part in parts:
            try:
                s.sendall(part)
                while chunk := s.recv(65536):  # wait out the pause, reading any answer
                    out += chunk
                break  # the server closed the connection
            except TimeoutError:
                continue
            except OSError:
                break
        s.settimeout(10)
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                out += chunk
        return out, time.monotonic() - t0


def test_a_head_or_body_that_stops_coming_is_a_408_and_the_connection_closes() -> None:
    """Slowloris: a head sent a byte at a time, a silent connection, a body that stalls.
    Each is cut off at its timeout with a 408 in the API's shape; a client that keeps
    its body coming within the pause limit is served however long it takes."""
    protocol = HeadCorkedHttpToolsProtocol.with_read_timeouts(1.0, 1.0)
    with uvicorn_in_thread(_echo, http=protocol) as url:
        head = b"POST / HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 6\r\n\r\n"
        for parts in ([head[i : i + 1] for i in range(len(head))], [b""], [head, b"abc"]):
            answer, took = _slow(url, parts, pause_s=0.2 if len(parts) > 2 else 3.0)
            status, headers, error = _error(answer)
            assert status == 408 and error["code"] == "request_timeout", answer
            assert headers["connection"] == "close" and 0.9 < took < 8, took
        # A body in pieces, each within the limit: longer than it in all, and served.
        answer, _ = _slow(url, [head, b"ab", b"cd", b"ef"], pause_s=0.4)
        assert answer.startswith(b"HTTP/1.1 200") and b"\r\n6\r\n" in answer
    # Without timeouts (the worker's internal API) nothing is cut off.
    assert HeadCorkedHttpToolsProtocol.head_timeout_s is None
