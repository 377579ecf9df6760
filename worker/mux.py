"""``POST /generate/mux``: many generations over one long-lived HTTP/1.1 exchange.

The control plane keeps one of these open per worker. Its request body is a stream of
newline-delimited operations; the response body a stream of newline-delimited frames, each
tagged with the request it belongs to:

  → {"op": "generate", "request": <GenerateRequest>}
  → {"op": "abort", "request_id": "..."}
  ← {"id": "...", "event": <GenerateEvent>}           as ``POST /generate`` streams them
  ← {"id": "...", "error": {"status", "message", "type"}}  refused before its first event
  ← {"id": "...", "end": true}                          nothing more for that request

Why: with one connection per request, each decode step of a batch of 32 streams cost the
control plane 32 wake-ups and ``recv`` calls, and each request a connection. Here every
event leaves as soon as it is encoded (``hotpool.http_protocol``: the control plane relays
the first streams' events while the worker still encodes the rest of the step's), and the
control plane's reader takes whatever has arrived in one ``recv``. The control plane ending
its request body means "no more requests": the running ones finish, then the response ends.
A lost connection aborts everything it was running.

While the worker is shutting down (``stopping()``), new generations are refused with 503
and the exchange ends as soon as nothing runs on it, so it never holds up the shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

from starlette.types import Receive, Scope, Send

from hotpool.worker.engine.base import RequestRejected
from hotpool.worker.protocol import GenerateEvent, GenerateRequest, wire_dumps, wire_loads
from hotpool.worker.service import NotLoaded, WorkerService
from hotpool.worker.tokenizer import TemplateError

log = logging.getLogger(__name__)

STOP_POLL_S = 0.25  # how often an idle exchange checks whether the worker is stopping


class EventSink(Protocol):
    """Counts what the streams carried (the worker's metrics)."""

    def finished(self, reason: str) -> None: ...

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None: ...


class Multiplexer:
    """The ASGI app of ``POST /generate/mux`` (behind the worker's bearer auth)."""

    def __init__(
        self, service: WorkerService, sink: EventSink, stopping: Callable[[], bool]
    ) -> None:
        self.service = service
        self.sink = sink
        self.stopping = stopping

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _Exchange(self, send).run(receive)


class _Exchange:
    """One open ``/generate/mux``: its running requests.

    Each generation writes its own frames (one ASGI ``send`` per event, as ``/generate``
    does), each leaving at once. A writer task in between would cost each event one more
    pass of the loop, and on a worker each pass can wait for the GIL behind the engine
    thread's step."""

    def __init__(self, mux: Multiplexer, send: Send) -> None:
        self.mux = mux
        self.send = send
        self.running: dict[str, asyncio.Task[None]] = {}
        self.waiter: asyncio.Future[None] | None = None  # run(), waiting for news

    async def run(self, receive: Receive) -> None:
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/x-ndjson")],
            }
        )
        loop = asyncio.get_running_loop()
        reading = asyncio.ensure_future(self._read(receive))
        reading.add_done_callback(lambda _: self._wake())
        try:
            while True:
                self.waiter = loop.create_future()
                # Idle: look again now and then whether the worker is stopping.
                timer = None if self.running else loop.call_later(STOP_POLL_S, self._wake)
                await self.waiter
                if timer is not None:
                    timer.cancel()
                if reading.done() and not reading.result():
                    return  # disconnected: nothing can be delivered any more
                if not self.running and (reading.done() or self.mux.stopping()):
                    await self.send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
        finally:
            reading.cancel()
            for task in list(self.running.values()):
                task.cancel()  # the connection is gone: closing the streams aborts them
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            await asyncio.gather(*self.running.values(), return_exceptions=True)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def _read(self, receive: Receive) -> bool:
        """The operations, as they come; True when the body ended (no more requests), False
        when the client disconnected."""
        buffer = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            buffer += message.get("body", b"")
            if b"\n" in buffer:
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        await self._operation(line)
            if not message.get("more_body", False):
                return True

    async def _operation(self, line: bytes) -> None:
        op: Any = None
        try:
            op = wire_loads(line)
            kind = op["op"]
            if kind == "abort":
                self.mux.service.abort(str(op["request_id"]))
                return
            if kind != "generate":
                raise ValueError(f"unknown op {kind!r}")
            req = GenerateRequest.from_json(op["request"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            request = op.get("request") if isinstance(op, dict) else None
            rid = request.get("request_id") if isinstance(request, dict) else None
            log.warning("malformed mux operation: %s", exc)
            if isinstance(rid, str):
                await self._refuse(rid, 400, f"malformed generate request: {exc}")
            return
        rid = req.request_id
        if rid in self.running:
            await self._refuse(rid, 409, f"request {rid} is already running here", "conflict")
        elif self.mux.stopping():
            await self._refuse(rid, 503, "the worker is shutting down", "unavailable")
            self._wake()  # nothing may run any more: the exchange can end now, not at a poll
        else:
            self.running[rid] = asyncio.ensure_future(self._generate(req))

    async def _refuse(
        self,
        rid: str,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        error = {"status": status, "message": message, "type": kind, "code": code}
        await self._write(wire_dumps({"id": rid, "error": error}) + b"\n" + _end_line(rid))

    async def _generate(self, req: GenerateRequest) -> None:
        rid = req.request_id
        head = wire_dumps({"id": rid})[:-1] + b',"event":'
        events = self.mux.service.generate(req)
        try:
            try:
                event: GenerateEvent | None = await anext(events)
            except NotLoaded as exc:
                await self._refuse(rid, 409, str(exc), "not_loaded")
                return
            except (RequestRejected, TemplateError) as exc:
                await self._refuse(rid, 400, str(exc), code=getattr(exc, "code", None))
                return
            except StopAsyncIteration:
                event = None
            last = event
            while event is not None:
                if event.finish_reason is not None:
                    self.mux.sink.finished(event.finish_reason)
                await self._write(head + wire_dumps(event.to_json()) + b"}\n")
                last, event = event, await anext(events, None)
            await self._write(_end_line(rid))
            if last is not None and last.usage is not None:
                self.mux.sink.usage(last.usage.prompt_tokens, last.usage.completion_tokens)
        except asyncio.CancelledError:
            raise  # the exchange is over: nobody to tell
        except Exception as exc:  # a failure mid-stream ends it with an error event
            log.exception("generation %s failed", rid)
            failed = GenerateEvent(finish_reason="error", error=str(exc))
            await self._write(head + wire_dumps(failed.to_json()) + b"}\n" + _end_line(rid))
        finally:
            self.running.pop(rid, None)
            self._wake()
            await events.aclose()  # before its end: aborts the engine's requests


def _end_line(rid: str) -> bytes:
    return wire_dumps({"id": rid, "end": True}) + b"\n"
