"""The control plane's end of ``POST /generate/mux`` (``hotpool.worker.mux``): one
long-lived connection per worker carrying every generation the control plane runs there.

A generation is one ``generate`` operation written on the connection's request body and,
back, the frames tagged with its request id, dispatched by one reader task per connection
to the :class:`MuxStream` of that request. The worker sends each event as it is encoded;
the reader takes whatever has arrived by the time it runs (while it relays a step's first
events, the rest arrive) in one ``recv`` and one decode, where one connection per request
took a wake-up and a ``recv`` each. A new request is written at once; what else the control
plane writes in one pass of its event loop (aborts) leaves in one write.

Failures keep the per-request client's contract (:mod:`hotpool.platform.worker_stream`):
a connection that cannot be made raises ``httpx.ConnectError``, one lost mid-way raises
``httpx.ReadError`` in every stream still open on it, so the invoker retries what had not
delivered a token yet. A worker that refuses a request (not loaded, bad prompt, shutting
down) answers with an error frame, raised as :class:`WorkerRefused` by the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from hotpool.platform.worker_stream import connect, read_response
from hotpool.worker.protocol import GenerateEvent, wire_dumps, wire_loads

log = logging.getLogger(__name__)

MUX_PATH = "/generate/mux"


class WorkerRefused(Exception):
    """The worker answered a generation with an error before its first event."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


class _End:
    pass


_END = _End()


class MuxStream:
    """The events of one generation, as its connection's reader hands them over."""

    __slots__ = ("_items", "_loop", "_waiter", "ended", "request_id")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._items: deque[GenerateEvent | _End | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.ended = False  # the worker said so: nothing to abort there

    def put(self, item: GenerateEvent | _End | BaseException) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> MuxStream:
        return self

    async def __anext__(self) -> GenerateEvent:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, GenerateEvent):
            return item
        self.ended = True
        if isinstance(item, _End):
            raise StopAsyncIteration
        raise item


class WorkerMux:
    """One open ``/generate/mux`` exchange with one worker."""

    def __init__(
        self,
        key: tuple[str, int],
        netloc: str,
        auth: bytes,
        on_close: Callable[[WorkerMux], None] = lambda _: None,
    ) -> None:
        self.key = key
        self._netloc = netloc
        self._auth = auth
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()  # made by a coroutine, used on its loop
        self._streams: dict[str, MuxStream] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._pending: list[bytes] = []
        self._reading: asyncio.Task[None] | None = None
        self.closed = False
        self.error: BaseException | None = None

    async def start(self) -> None:
        """Connect and wait for the worker's response head (it answers at once)."""
        reader, writer = await connect(self.key)
        self._writer = writer
        writer.write(
            (
                f"POST {MUX_PATH} HTTP/1.1\r\nhost: {self._netloc}\r\n"
                "content-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n"
            ).encode()
            + b"authorization: "
            + self._auth
            + b"\r\n\r\n"
        )
        try:
            response = await read_response(reader)
            if response.status != 200:
                body = await response.read()
                raise httpx.RemoteProtocolError(
                    f"the worker refused {MUX_PATH}: {response.status} {body[:200]!r}"
                )
        except BaseException:
            writer.close()
            raise
        self._reading = self._loop.create_task(self._read(response.line_batches()))

    def open(self, request_id: str, request: dict[str, Any]) -> MuxStream:
        """Start a generation (``request``: a ``GenerateRequest`` as JSON)."""
        if self.closed:
            raise httpx.ReadError(f"the connection to the worker is gone: {self.error!r}")
        if request_id in self._streams:
            raise ValueError(f"request {request_id} is already open on this worker")
        stream = self._streams[request_id] = MuxStream(request_id, self._loop)
        # Sent now rather than with the rest of this loop pass: a burst of requests reaches
        # the worker one by one as each is admitted here, so the worker parses and schedules
        # the first while this process still admits the others (joined, the first waited
        # for the whole burst's admission).
        self._send({"op": "generate", "request": request}, now=True)
        return stream

    def close_stream(self, stream: MuxStream) -> None:
        """The caller is done with ``stream``; a generation still running is aborted."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            if not stream.ended and not self.closed:
                self._send({"op": "abort", "request_id": stream.request_id})

    async def aclose(self) -> None:
        self._fail(httpx.ReadError("the control plane closed the connection"))
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def _send(self, op: dict[str, Any], now: bool = False) -> None:
        line = wire_dumps(op) + b"\n"
        if not self._pending and not now:
            self._loop.call_soon(self._flush)
        self._pending.append(b"%x\r\n%s\r\n" % (len(line), line))
        if now:
            self._flush()

    def _flush(self) -> None:
        # What this pass of the event loop asked for, in one write.
        if not self._pending or self._writer is None:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._writer.is_closing():
            self._writer.write(data)

    async def _read(self, batches: AsyncIterator[list[bytes]]) -> None:
        error: BaseException = httpx.ReadError("the worker ended the connection")
        streams = self._streams
        try:
            async for lines in batches:
                # The frames of one read (all that had arrived), decoded in one call.
                frames = wire_loads(b"[" + b",".join(lines) + b"]")
                for frame in frames:
                    stream = streams.get(frame["id"])
                    if stream is None:
                        continue  # closed by its caller: the rest of it is nobody's
                    if (event := frame.get("event")) is not None:
                        stream.put(GenerateEvent.from_json(event))
                    elif (err := frame.get("error")) is not None:
                        stream.put(
                            WorkerRefused(
                                int(err["status"]),
                                str(err["message"]),
                                err["type"],
                                err.get("code"),
                            )
                        )
                    elif frame.get("end"):
                        stream.put(_END)
        except httpx.TransportError as exc:
            error = exc
        except (ValueError, KeyError, TypeError) as exc:
            error = httpx.RemoteProtocolError(f"bad frame from the worker: {exc!r}")
        except asyncio.CancelledError:
            raise
        finally:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        """The connection is over: every stream still open ends with ``error``."""
        if self.closed:
            return
        self.closed, self.error = True, error
        for stream in self._streams.values():
            if not stream.ended:
                stream.put(error)
        self._streams.clear()
        if self._writer is not None:
            self._writer.close()
        self._on_close(self)


class WorkerMuxes:
    """One :class:`WorkerMux` per worker address, made on first use and again after a
    connection is lost."""

    def __init__(self, token: str) -> None:
        self._auth = f"Bearer {token}".encode()
        self._muxes: dict[tuple[str, int], WorkerMux] = {}
        self._starting: dict[tuple[str, int], asyncio.Task[WorkerMux]] = {}
        # address -> ((host, port), netloc)
        self._addresses: dict[str, tuple[tuple[str, int], str]] = {}

    @contextlib.asynccontextmanager
    async def generate(
        self, address: str, request_id: str, request: dict[str, Any]
    ) -> AsyncIterator[MuxStream]:
        """The events of ``request`` run on the worker at ``address`` (``http://host:port``)."""
        mux = await self._mux(address)
        stream = mux.open(request_id, request)
        try:
            yield stream
        finally:
            mux.close_stream(stream)

    async def aclose(self) -> None:
        for task in list(self._starting.values()):
            task.cancel()
        for mux in list(self._muxes.values()):
            await mux.aclose()

    async def _mux(self, address: str) -> WorkerMux:
        parsed = self._addresses.get(address)
        if parsed is None:  # parsed once per address: a request's admission is ~150 us in all
            if len(self._addresses) >= 1024:  # workers come and go with new ports: bounded
                self._addresses.clear()
            parts = urlsplit(address)
            key = (parts.hostname or "127.0.0.1", parts.port or 80)
            parsed = self._addresses[address] = (key, parts.netloc)
        key, netloc = parsed
        mux = self._muxes.get(key)
        if mux is not None and not mux.closed:
            return mux
        starting = self._starting.get(key)
        if starting is None:  # the first caller connects; the others wait for it
            starting = asyncio.get_running_loop().create_task(self._start(key, netloc))
            self._starting[key] = starting
        return await asyncio.shield(starting)

    def _forget(self, mux: WorkerMux) -> None:
        if self._muxes.get(mux.key) is mux:
            del self._muxes[mux.key]

    async def _start(self, key: tuple[str, int], netloc: str) -> WorkerMux:
        try:
            mux = WorkerMux(key, netloc, self._auth, self._forget)
            await mux.start()
            self._muxes[key] = mux
            return mux
        finally:
            del self._starting[key]
