"""A lean ASGI streaming response for the token streams (SSE to clients, NDJSON to the
control plane).

Every generated token crosses one of these per hop, so what it costs per request and per
chunk is latency the user sees. Starlette's ``StreamingResponse`` spends ~0.1 ms per
response on an anyio task group (one task streams, one waits for the disconnect; uvicorn
reports ASGI 2.3, so Starlette cannot rely on a failing ``send`` instead) and, because its
last message is an empty one sent after the iterator is exhausted, the end of the stream
waits for whatever cleanup the iterator does after its last chunk.

:class:`ChunkStream` streams in the handler's own task. One small task (a
:class:`DisconnectWatch`) waits for the client's ``http.disconnect`` and cancels the stream
if it comes first; that cancellation is this response's own (uncancelled and swallowed
here), so the iterator is closed exactly as Starlette would close it and nothing is logged
as an error. A handler can start the watch earlier, before the response exists (a request
waiting in a queue, a non-streamed generation), and hand it to the stream. A chunk wrapped in
:class:`Last` goes out with ``more_body: False`` in the same ``send`` (one write for the
final data and the chunked terminator), and the iterator's remainder then runs with the
client already served: a relay drains its upstream there, a meter writes its record.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client gave up on
T = TypeVar("T")


class Last(bytes):
    """The final chunk of a stream: sent with the end of the response, in one write."""

    __slots__ = ()


class ChunkStream:
    """``200`` (or ``status_code``) with ``chunks`` as the body, as they come.

    ``chunks`` yields ``bytes``; a :class:`Last` ends the response at once (anything the
    iterator yields after it is dropped, but it runs to its end). Without a ``Last`` the
    response ends when the iterator does.
    """

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        media_type: str,
        headers: Mapping[str, str] | None = None,
        status_code: int = 200,
        watch: DisconnectWatch | None = None,
    ) -> None:
        self.chunks = chunks
        self.status_code = status_code
        self.watch = watch  # the handler's, if it started one; else one is started here
        self.raw_headers = [(b"content-type", media_type.encode("latin-1"))]
        if headers:
            self.raw_headers += [
                (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
            ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.watch or DisconnectWatch(receive)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            await self._stream(send, state)
        except asyncio.CancelledError:
            if not state.absorb():
                raise  # not ours (the server is stopping): let it through
            # ours: the client went away, and the stream has been closed
        finally:
            state.stop()

    async def _stream(self, send: Send, state: DisconnectWatch) -> None:
        chunks = self.chunks
        ended = False
        try:
            async for chunk in chunks:
                if ended:
                    continue  # the client has everything: the rest is the iterator's cleanup
                last = isinstance(chunk, Last)
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    ended = True
                    # The end is out (written at once: hotpool.http_protocol); what the
                    # iterator does next is its cleanup, and a disconnect now is no news.
                    state.armed = False
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(chunks, "aclose", None)  # an async generator's: run its cleanup now
            if aclose is not None:
                await aclose()


class DisconnectWatch:
    """Cancels the task that starts it (a request's handler) when the client disconnects,
    while ``armed``. After a ``CancelledError``, :meth:`absorb` tells whether the watch
    caused it (and then uncancels the task): the client went away, nobody reads the answer.
    Start it once the request body has been read (``receive`` then yields only the
    disconnect); :meth:`stop` it when the response is out."""

    __slots__ = ("_task", "_watcher", "armed", "fired")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self.armed = True  # a disconnect now should stop the task
        self.fired = False  # this watch cancelled the task
        self._watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        self._watcher.add_done_callback(self._gone)

    def _gone(self, watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled() or watcher.exception() is not None or not self.armed:
            return
        self.fired = True
        self._task.cancel()

    def absorb(self) -> bool:
        """Call on ``CancelledError``: True (and the task uncancelled) if it was this
        watch's; False if it came from elsewhere (the server stopping) and must go on."""
        if not self.fired:
            return False
        self.fired = False
        # Another cancel in the same pass (the server's drain running out) still stands.
        return self._task.uncancel() == 0

    def stop(self) -> None:
        self.armed = False
        self._watcher.cancel()


async def while_connected(
    receive: Receive,
    events: AsyncIterator[T],
    respond: Callable[[T, DisconnectWatch], Awaitable[Response]],
) -> Response:
    """``respond(first event, watch)``: the answer to a request whose ``events`` (a
    generation) end early if its client goes away meanwhile: while the first event is
    awaited (the request waits in a queue or a cold start, and its place goes to the next)
    or, for an answer sent whole, while the rest are collected. A :class:`ChunkStream`
    made with the watch keeps it for the stream; otherwise it stops here."""
    watch = DisconnectWatch(receive)
    kept = False
    try:
        response = await respond(await anext(events), watch)
        kept = isinstance(response, ChunkStream) and response.watch is watch
        return response
    except asyncio.CancelledError:
        if not watch.absorb():
            raise
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
        return client_gone()
    finally:
        if not kept:
            watch.stop()


def client_gone() -> Response:
    """The answer to a request whose client went away (a :class:`DisconnectWatch` fired):
    nobody reads it, but the access log and the metrics show it as 499."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _wait_for_disconnect(receive: Receive) -> None:
    # The request body has been read by the time a stream starts; what comes next is the
    # disconnect (uvicorn also answers it once the response is complete).
    while (await receive())["type"] != "http.disconnect":
        pass
