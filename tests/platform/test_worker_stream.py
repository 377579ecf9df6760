"""The lean worker client against a real uvicorn server on loopback: streamed lines,
keep-alive reuse, early close, error bodies, and httpx's exceptions on failure."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hotpool.platform.worker_stream import WorkerStreams, parse_chunks

PEERS: set[tuple[str, int]] = set()  # client addresses seen: one per connection


async def generate(request: Request) -> Response:
    PEERS.add(request.client)  # type: ignore[arg-type]
    if request.headers.get("authorization") != "Bearer t0k":
        return JSONResponse({"error": {"message": "bad token"}}, status_code=401)
    body = await request.json()

    async def lines() -> AsyncIterator[bytes]:
        for i in range(body["n"]):
            yield (json.dumps({"i": i, "pad": "x" * body.get("pad", 0)}) + "\n").encode()
            await asyncio.sleep(0)

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = _free_port()
    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_keep_alive=1)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


async def _lines(streams: WorkerStreams, url: str, n: int, pad: int = 0) -> list[dict[str, int]]:
    body = json.dumps({"n": n, "pad": pad}).encode()
    async with streams.post(f"{url}/generate", body) as response:
        assert response.status == 200
        return [json.loads(line) async for line in response.lines()]


def test_lines_arrive_whole_and_connections_are_reused(url: str) -> None:
    async def scenario() -> None:
        streams = WorkerStreams("t0k")
        PEERS.clear()
        for n in (5, 0, 300):
            got = await _lines(streams, url, n, pad=1000)  # lines larger than a chunk read
            assert [x["i"] for x in got] == list(range(n))
        assert len(PEERS) == 1  # one kept-alive connection served all three
        # Concurrent requests take connections of their own.
        results = await asyncio.gather(*(_lines(streams, url, 20) for _ in range(8)))
        assert all(len(r) == 20 for r in results)
        await streams.aclose()

    asyncio.run(scenario())


def test_an_early_stop_closes_the_connection_and_the_next_one_is_fresh(url: str) -> None:
    async def scenario() -> None:
        streams = WorkerStreams("t0k")
        PEERS.clear()
        async with streams.post(f"{url}/generate", b'{"n": 1000}') as response:
            async for _ in response.lines():
                break  # the caller went away mid-stream
        assert await _lines(streams, url, 3) == [{"i": i, "pad": ""} for i in range(3)]
        assert len(PEERS) == 2
        await streams.aclose()

    asyncio.run(scenario())


def test_an_error_body_is_read_and_a_dead_worker_is_a_transport_error(url: str) -> None:
    async def scenario() -> None:
        wrong = WorkerStreams("nope")
        async with wrong.post(f"{url}/generate", b"{}") as response:
            assert response.status == 401
            assert json.loads(await response.read())["error"]["message"] == "bad token"
        streams = WorkerStreams("t0k")
        with pytest.raises(httpx.ConnectError):
            async with streams.post(f"http://127.0.0.1:{_free_port()}/generate", b"{}"):
                pass

    asyncio.run(scenario())


def test_a_kept_alive_connection_the_worker_closed_is_retried_fresh(url: str) -> None:
    async def scenario() -> None:
        streams = WorkerStreams("t0k")
        await _lines(streams, url, 1)
        await asyncio.sleep(1.5)  # past uvicorn's keep-alive timeout: it closed our socket
        assert len(await _lines(streams, url, 2)) == 2
        await streams.aclose()

    asyncio.run(scenario())


def _chunked(*payloads: bytes, trailers: bytes = b"") -> bytes:
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in payloads)
    return body + b"0\r\n" + trailers + b"\r\n"


def test_chunk_parsing_is_the_same_however_the_bytes_arrive() -> None:
    payloads = [b"a", b"{" + b"x" * 300 + b"}\n", b"\r\n\r\n", b"last\n"]
    body = _chunked(*payloads, trailers=b"x-trailer: 1\r\n")
    # Whole, then in every split into two reads, then a byte per read.
    splits = [[body]] + [[body[:i], body[i:]] for i in range(1, len(body))]
    splits.append([body[i : i + 1] for i in range(len(body))])
    for reads in splits:
        buffer, got, last = b"", [], False
        for data in reads:
            assert not last, "nothing is parsed after the last chunk"
            buffer += data
            used, last = parse_chunks(buffer, got)
            buffer = buffer[used:]
        assert last and buffer == b"" and got == payloads


@pytest.mark.parametrize(
    "body",
    [b"zz\r\nab\r\n", b"-1\r\nab\r\n", b"2\r\nabc\r\n", b"\r\n", b"f" * (70 * 1024)],
)
def test_chunk_parsing_refuses_what_is_not_chunked_encoding(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_chunks(body, [])
