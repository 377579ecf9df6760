"""A lean HTTP/1.1 client for the workers' token streams, over plain asyncio streams.

Every token crosses the control plane → worker hop, so its cost per request and per event
is the control plane's added latency. httpx is general (HTTP/2, proxies, cookies, many
hooks) and costs about a millisecond of Python per request here; this speaks just the
HTTP/1.1 a worker (uvicorn) answers with: a request with a Content-Length body, a response
with a chunked or Content-Length body, keep-alive. :func:`connect` and
:func:`read_response` are what ``hotpool.platform.worker_mux`` (the invoker's one
connection per worker) is built on; :class:`WorkerStreams` runs one request per connection
(``POST /generate``), as the gateway benchmark's load generator does. Everything else
about the workers (load, unload, abort, health) goes through httpx.

Failures raise httpx's transport exceptions (``ConnectError``, ``ReadError``,
``RemoteProtocolError``), so callers keep one contract: the invoker retries a request that
failed before its first token on ``httpx.TransportError``, whichever client failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

MAX_IDLE_PER_WORKER = 64  # kept-alive connections per worker address
MAX_LINE = 64 * 1024  # a status line, a header, a chunk-size line
READ_SIZE = 256 * 1024  # what one read of a response body may take
CONNECT_TIMEOUT_S = 10.0

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class WorkerResponse:
    status: int
    headers: dict[str, str]
    _reader: asyncio.StreamReader
    _chunked: bool
    _length: int | None
    done: bool = False  # the whole body was read: the connection may be reused

    async def read(self) -> bytes:
        """The whole body (an error answer, say)."""
        return b"".join([part async for parts in self._batches() for part in parts])

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines without their newlines, as they arrive; empty lines skipped."""
        async for batch in self.line_batches():
            for line in batch:
                yield line

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        """The body's complete lines per read from the socket (empty lines skipped).

        A worker's decode step writes an event for each of its streams at once; they arrive
        in one read and are handed on together, without an ``await`` per line."""
        buffer = b""
        async for parts in self._batches():
            data = buffer + b"".join(parts) if buffer else b"".join(parts)
            if b"\n" not in data:
                buffer = data
                continue
            *complete, buffer = data.split(b"\n")
            batch = [line for line in complete if line]
            if batch:
                yield batch
        if buffer:
            yield [buffer]

    async def _batches(self) -> AsyncIterator[list[bytes]]:
        """The body's data per read: with chunked encoding, the chunks each read completed.

        The chunk framing is parsed from what one ``read`` returned, in a loop without
        ``await``: a ``readuntil`` and a ``readexactly`` per chunk cost more than the
        events inside them."""
        r = self._reader
        try:
            if not self._chunked:
                left = self._length
                while left is None or left > 0:
                    data = await r.read(READ_SIZE if left is None else min(left, READ_SIZE))
                    if not data:
                        if left is None:  # read to the end: the connection ends with it
                            return
                        raise httpx.ReadError("the worker closed the connection mid-body")
                    if left is not None:
                        left -= len(data)
                    yield [data]
                self.done = True
                return
            buffer = b""
            while True:
                data = await r.read(READ_SIZE)
                if not data:
                    raise httpx.ReadError("the worker closed the connection mid-body")
                buffer = buffer + data if buffer else data
                parts: list[bytes] = []
                used, last = parse_chunks(buffer, parts)
                buffer = buffer[used:]
                if parts:
                    yield parts
                if last:
                    # Anything after the last chunk is no answer to a request of ours.
                    self.done = not buffer
                    return
        except ValueError as exc:
            raise httpx.RemoteProtocolError(f"bad response from the worker: {exc!r}") from exc
        except (ConnectionError, OSError) as exc:
            raise httpx.ReadError(f"lost the worker: {exc!r}") from exc


def parse_chunks(buffer: bytes, out: list[bytes]) -> tuple[int, bool]:
    """The complete chunks at the start of ``buffer`` (a chunked body), appended to ``out``.

    Returns how many bytes they took and whether the last chunk (size 0, and its trailers)
    was among them; what is left is an incomplete chunk, to be parsed again with more
    data. Raises ``ValueError`` for anything that is not chunked encoding."""
    pos, end = 0, len(buffer)
    while True:
        eol = buffer.find(b"\r\n", pos)
        if eol < 0:
            if end - pos > MAX_LINE:
                raise ValueError("chunk-size line too long")
            return pos, False
        size = int(buffer[pos:eol].split(b";", 1)[0], 16)
        if size < 0:
            raise ValueError(f"negative chunk size {size}")
        if size == 0:
            # Trailer lines, if any, then an empty line: "0\r\n" [trailers] "\r\n".
            stop = buffer.find(b"\r\n\r\n", eol)
            if stop < 0:
                if end - eol > MAX_LINE:
                    raise ValueError("trailers too long")
                return pos, False
            return stop + 4, True
        start = eol + 2
        stop = start + size
        if stop + 2 > end:
            return pos, False
        if buffer[stop : stop + 2] != b"\r\n":
            raise ValueError("a chunk not followed by CRLF")
        out.append(buffer[start:stop])
        pos = stop + 2


class WorkerStreams:
    """Keep-alive connections to each worker, and one streamed request at a time on each."""

    def __init__(self, token: str) -> None:
        self._auth = f"Bearer {token}".encode()
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    @contextlib.asynccontextmanager
    async def post(self, url: str, body: bytes) -> AsyncIterator[WorkerResponse]:
        """``POST url`` with a JSON ``body``; the response, its body to be read inside."""
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        key = (host, port)
        head = (
            (
                f"POST {parts.path or '/'} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            ).encode()
            + b"authorization: "
            + self._auth
            + b"\r\n\r\n"
        )
        reader, writer, reused = await self._connection(key)
        response: WorkerResponse | None = None
        try:
            try:
                writer.write(head + body)
                await writer.drain()
                response = await read_response(reader)
            except httpx.TransportError:
                if not reused:
                    raise
                # A kept-alive connection the worker closed meanwhile: once more, fresh.
                writer.close()
                reader, writer, _ = await self._connection(key, fresh=True)
                writer.write(head + body)
                await writer.drain()
                response = await read_response(reader)
            yield response
        finally:
            if response is not None and response.done and not _closing(response):
                self._release(key, (reader, writer))
            else:
                writer.close()  # mid-body (the caller stopped early) or broken: not reusable

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()

    async def _connection(
        self, key: tuple[str, int], fresh: bool = False
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        idle = self._idle.get(key)
        while idle and not fresh:
            reader, writer = idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer, True
            writer.close()
        reader, writer = await connect(key)
        return reader, writer, False

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < MAX_IDLE_PER_WORKER:
            idle.append(conn)
        else:
            conn[1].close()


async def connect(key: tuple[str, int]) -> _Conn:
    """A new connection to the worker at ``key`` (host, port), Nagle off."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(*key, limit=MAX_LINE), CONNECT_TIMEOUT_S
        )
    except (OSError, TimeoutError) as exc:
        raise httpx.ConnectError(f"cannot reach the worker at {key[0]}:{key[1]}: {exc!r}") from exc
    sock = writer.get_extra_info("socket")
    if sock is not None:  # each event is a small write that must not wait (Nagle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


async def read_response(reader: asyncio.StreamReader) -> WorkerResponse:
    """A response's status line and headers; its body is left to read."""
    try:
        status_line = await reader.readuntil(b"\r\n")
        if not status_line.startswith(b"HTTP/1."):
            raise httpx.RemoteProtocolError(f"not an HTTP response: {status_line[:40]!r}")
        status = int(status_line.split(b" ", 2)[1])
        headers: dict[str, str] = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
    except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
        raise httpx.ReadError(f"the worker closed the connection: {exc!r}") from exc
    except (asyncio.LimitOverrunError, ValueError, IndexError) as exc:
        raise httpx.RemoteProtocolError(f"bad response from the worker: {exc!r}") from exc
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    length = None if chunked else int(headers.get("content-length", "-1"))
    return WorkerResponse(status, headers, reader, chunked, None if length == -1 else length)


def _closing(response: WorkerResponse) -> bool:
    return response.headers.get("connection", "").lower() == "close"
