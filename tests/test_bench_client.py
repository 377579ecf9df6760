"""benchmarks/stream_client.c, bench_gateway.py's load client, against a server that sends
hand-made HTTP: what it times and counts must be right, or the benchmark's numbers are not.

The server (raw asyncio, in a thread) splits lines across chunks and reads, answers errors
with a length-delimited body, closes idle connections, and can hang; each case checks what
the client reports against what was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from native_client import NativeClient, Target, build

GAP_S = 0.05  # the server's pause before the first text: TTFT must include it


@dataclass
class Server:
    url: str = ""
    connections: int = 0
    bodies: list[bytes] = field(default_factory=list)
    close_idle: bool = False  # close each connection after one response (a keep-alive timeout)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def respond(path: str, w: asyncio.StreamWriter) -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nX-Hotpool-Request-Id: req-%s\r\n"
    if path == "/sse":
        w.write(head % b"sse" + b"content-type: text/event-stream\r\n\r\n")
        w.write(chunk(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": null}]}\n\n'))
        await w.drain()
        await asyncio.sleep(GAP_S)
        # one SSE line split across two chunks and two writes
        w.write(chunk(b'data: {"choices": [{"index": 0, "text": "Hel'))
        await w.drain()
        await asyncio.sleep(0.01)
        w.write(chunk(b'lo", "finish_reason": null}]}\n\n'))
        usage = b'"usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}'
        w.write(chunk(b'data: {"choices": [], ' + usage + b"}\n\ndata: [DONE]\n\n"))
        w.write(b"0\r\n\r\n")
    elif path == "/ndjson":
        w.write(head % b"nd" + b"\r\n")
        lines = [
            b'{"text": "", "token_ids": [], "finish_reason": null, "usage": null}\n',
            b'{"text": "a\\"b", "token_ids": [5], "finish_reason": null, "usage": null}\n',
            b'{"text": "", "token_ids": [], "finish_reason": "length", "usage": '
            b'{"prompt_tokens": 1, "completion_tokens": 4, "cached_tokens": 0}}\n',
        ]
        w.write(chunk(lines[0]))
        await w.drain()
        await asyncio.sleep(GAP_S)
        w.write(chunk(lines[1] + lines[2]) + b"0\r\n\r\n")
    elif path == "/sse-error":
        w.write(head % b"err" + b"\r\n")
        error = b'data: {"error": {"message": "generation failed: boom", "type": "x"}}\n\n'
        w.write(chunk(error + b"data: [DONE]\n\n") + b"0\r\n\r\n")
    elif path == "/unfinished":  # ends without [DONE]
        w.write(head % b"u" + b"\r\n" + chunk(b'data: {"choices": []}\n\n') + b"0\r\n\r\n")
    elif path == "/busy":
        body = b'{"error": {"message": "no replica", "type": "unavailable"}}'
        w.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n" % len(body))
        w.write(body)
    elif path == "/hang":
        w.write(head % b"h" + b"\r\n")
        await asyncio.sleep(30)
    await w.drain()


async def handle(srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    srv.connections += 1
    srv.writers.add(w)
    try:
        while True:
            try:
                head = await r.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            path = head.split(b" ", 2)[1].decode()
            length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
            srv.bodies.append(await r.readexactly(length))
            closing = srv.close_idle  # decided when the request arrives, not after the answer
            await respond(path, w)
            if closing:
                return
    finally:
        srv.writers.discard(w)
        w.close()


@contextlib.contextmanager
def raw_server() -> Iterator[Server]:
    srv = Server()
    loop = asyncio.new_event_loop()
    started = threading.Event()

    stop = asyncio.Event()

    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: handle(srv, r, w), "127.0.0.1", 0)
        srv.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        started.set()
        await stop.wait()
        server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield srv
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = build(tmp_path_factory.mktemp("stream-client"))
    assert built is not None, "no C compiler: the benchmark falls back to its Python client"
    return built


def client(binary: Path, srv: Server, timeout_s: float = 10.0) -> NativeClient:
    body = {"request_id": "bench-@@REQUEST_ID@@", "prompt": "hi"}
    targets = [
        Target(name, mode, srv.url + "/" + name, "Bearer k", body)
        for name, mode in (
            ("sse", "sse"), ("ndjson", "ndjson"), ("sse-error", "sse"),
            ("unfinished", "sse"), ("busy", "sse"), ("hang", "sse"),
        )
    ]  # fmt: skip
    return NativeClient(binary, targets, timeout_s)


def test_times_counts_and_ids_of_sse_and_ndjson_streams(binary: Path) -> None:
    with raw_server() as srv:
        c = client(binary, srv)
        try:
            t0 = time.perf_counter()
            sse = c.batch("sse", 5)
            wall = time.perf_counter() - t0
            nd = c.batch("ndjson", 3)
        finally:
            c.close()
    assert len(sse) == 5 and len(nd) == 3
    for o in sse:
        assert o.error is None
        assert o.request_id == "req-sse"
        assert o.tokens == 7  # from the usage chunk
        # the first event had empty text: TTFT is the split line's, after the pause
        assert o.ttft is not None and GAP_S <= o.ttft <= o.total <= wall
    for o in nd:
        assert (o.error, o.request_id, o.tokens) == (None, "req-nd", 4)
        assert o.ttft is not None and GAP_S <= o.ttft <= o.total
    ids = [
        re.fullmatch(rb'\{"request_id": "bench-([0-9a-f]{32})", "prompt": "hi"\}', b)
        for b in srv.bodies
    ]
    assert all(ids) and len({m.group(1) for m in ids if m}) == 8  # a fresh id per request


def test_connections_are_kept_between_batches_and_replaced_when_closed(binary: Path) -> None:
    with raw_server() as srv:
        c = client(binary, srv)
        try:
            assert all(o.error is None for o in c.batch("sse", 4))
            assert all(o.error is None for o in c.batch("sse", 4))
            assert srv.connections == 4  # the second batch reused the first one's
            srv.close_idle = True  # the server now closes each connection after answering
            assert all(o.error is None for o in c.batch("sse", 4))
            assert srv.connections == 4
            time.sleep(0.2)  # ... and those four are now closed: the client must notice
            assert all(o.error is None for o in c.batch("sse", 4))
            assert srv.connections == 8
        finally:
            c.close()


def test_errors_are_reported_not_timed_as_successes(binary: Path) -> None:
    with raw_server() as srv:
        c = client(binary, srv, timeout_s=0.5)
        try:
            [failed] = c.batch("sse-error", 1)
            [unfinished] = c.batch("unfinished", 1)
            [busy] = c.batch("busy", 1)
            t0 = time.perf_counter()
            [hung] = c.batch("hang", 1)
            waited = time.perf_counter() - t0
            [after] = c.batch("sse", 1)  # the client still works after a timeout
        finally:
            c.close()
    assert failed.error == "generation failed: boom" and failed.ttft is None
    assert unfinished.error == "stream ended without [DONE]"
    assert busy.error is not None and busy.error.startswith("HTTP 503: {")
    assert "no replica" in busy.error
    assert hung.error is not None and hung.error.startswith("TimeoutError")
    assert 0.5 <= waited < 5
    assert after.error is None and after.tokens == 7
