"""uvicorn's HTTP protocol with each response's head held for its first body bytes.

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start``, and each body message in a write of its own. A token stream's
headers and first chunk are sent back to back, so the client was woken twice; on a small
machine the first wake-up lets the client's process take the core while the server still
has the first token to write (measured on the control plane: 0.24 ms at the median
between the two, 1.4 ms at p90, inside the time to first token).

:class:`HeadCorkedHttpToolsProtocol` holds a response head until the response's first body
write, which takes it along (one system call, one wake-up), or until the end of the event
loop's pass if no body comes in it; body writes go out at once. Both processes use it:

- the control plane writes to many clients: in a pass that relays a decode step's tokens to
  32 streams, holding every write to the end of the pass made the first stream's token wait
  for all 32 streams' relay work (~1.5 ms at c=32);
- the worker's ``/generate/mux`` carries every stream on one connection. Held to the end of
  the pass, a step's 32 events left in one ``send``, and the control plane began relaying
  the first only once the worker had encoded the last; sent as each is encoded, the two
  processes work on them side by side (``benchmarks/bench_gateway.py`` at c=32, A/B in one
  run: the gateway's TTFT p50 1.9-2.1 ms lower, its total time no worse).

It also bounds a request's head (uvicorn's httptools protocol took a header of any size into
memory) and answers a request it cannot parse in the API's error shape, with an
``x-request-id``, where uvicorn wrote a plain-text 400.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# A request's line and headers together, at most (uvicorn's h11 protocol allows 16 KiB;
# nginx 32 KiB by default): API keys, a few cookies and proxy headers fit many times over.
MAX_HEAD_BYTES = 64 * 1024


def new_request_id() -> str:
    """A fresh request id: 128 random bits (as uuid4, less its 6 fixed bits, at a fifth of
    its cost: every request of a burst waits behind the ones admitted before it)."""
    return f"req_{os.urandom(16).hex()}"


# How every response head that uvicorn writes begins (its status lines; "100 Continue" too).
# A body write that happens to begin so is held to the end of the pass at worst, never lost.
_HEAD = b"HTTP/1.1 "


class CorkedTransport:
    """``transport``, with each response head held until the response's first body write
    (or the end of the event loop's pass)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []  # held, not written yet

    def write(self, data: bytes) -> None:
        if data.startswith(_HEAD):  # uvicorn writes a head whole
            if not self._parts:
                self._loop.call_soon(self._flush)  # the end of this pass at the latest
            self._parts.append(data)
        elif self._parts:  # the response's head, and its first body bytes
            self._parts.append(data)
            self._flush()
        elif not self._transport.is_closing():
            self._transport.write(data)

    def _flush(self) -> None:
        if not self._parts:
            return
        data = b"".join(self._parts)
        self._parts.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()  # what was written goes before the end of the connection
        self._transport.close()

    def abort(self) -> None:
        self._parts.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._parts))

    def __getattr__(self, name: str) -> Any:  # everything else is the transport's
        return getattr(self._transport, name)


class HeadCorkedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (``Config(http=...)``): response heads held for their
    first body bytes, request heads bounded (431 past ``MAX_HEAD_BYTES``), and the 400 for a
    request that does not parse as HTTP in the API's error shape.

    :meth:`with_read_timeouts` makes the variant that clients face: a request's head must
    arrive within ``head_timeout_s`` of its first byte (or of the connection), and its body
    may not pause longer than ``body_timeout_s`` between reads (as nginx's
    ``client_header_timeout`` and ``client_body_timeout``), or the answer is a 408 and the
    connection closes. Without them a client could hold a connection, and the request the
    app had started for it, open for ever by sending nothing more."""

    head_timeout_s: float | None = None
    body_timeout_s: float | None = None

    @classmethod
    def with_read_timeouts(
        cls, head_timeout_s: float, body_timeout_s: float
    ) -> type[HeadCorkedHttpToolsProtocol]:
        return type(
            "ClientFacingHttpProtocol", (cls,),
            {"head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s},
        )  # fmt: skip

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        corked = CorkedTransport(transport, self.loop)
        super().connection_made(corked)  # type: ignore[arg-type]
        self._head_bytes: int | None = 0  # bytes of a request head so far; None: in a body
        self._too_large = False  # the head just parsed is over MAX_HEAD_BYTES
        self._head_ended = False  # a head ended in the read being parsed
        self._read_timer: asyncio.TimerHandle | None = None
        self._arm(self.head_timeout_s)  # a connection that says nothing is a slow head

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        in_head = self._head_bytes is not None
        if in_head and self._read_timer is None:
            self._arm(self.head_timeout_s)  # the first bytes of a kept-alive connection's next
        elif not in_head:
            self._arm(self.body_timeout_s)  # the body goes on: its pause starts again
        self._head_ended = False
        super().data_received(data)
        if (
            in_head
            and not self._head_ended
            and self._head_bytes is not None
            and not self.transport.is_closing()
        ):
            # Still in the same head after this read (the parser keeps what it has of it,
            # so this bounds the memory a head can take). A head that ends in a read is
            # measured whole in on_headers_complete, and the rest of that read is its body
            # (a whole small request's body, and the next request's head, can share it):
            # counting that read as head refused valid requests whose body came with it.
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._head_too_large()

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > MAX_HEAD_BYTES:
            # Raised out of the parser's callback, which uvicorn answers with
            # send_400_response (below): no request cycle starts.
            self._too_large = True
            raise ValueError("request head too large")
        self._head_bytes = None
        self._head_ended = True
        self._arm(self.body_timeout_s)  # cancelled at once by a message without a body
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head_bytes = 0  # the next request's head, if the connection is kept
        self._arm(None)  # the next head's clock starts at its first byte
        super().on_message_complete()

    def _arm(self, timeout_s: float | None) -> None:
        """(Re)start the read timer for ``timeout_s`` seconds (None: stop it)."""
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if timeout_s is not None:
            self._read_timer = self.loop.call_later(timeout_s, self._read_timed_out, timeout_s)

    def _read_timed_out(self, timeout_s: float) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self._head_bytes is None and self.flow.read_paused:
            self._arm(timeout_s)  # the app is not reading the body yet: not the client's pause
            return
        cycle = self.cycle
        if self._head_bytes is None and cycle is not None and cycle.response_started:
            self.transport.close()  # the app has answered already; nothing more can be said
            return
        where = "its headers" if self._head_bytes is not None else "more of its body"
        self._refuse(
            408, b"Request Timeout",
            f"the request was closed: {where} did not arrive within {timeout_s:g} s",
            "request_timeout",
        )  # fmt: skip

    def send_400_response(self, msg: str) -> None:  # uvicorn: the request does not parse
        if self._too_large:
            self._head_too_large()
            return
        self._refuse(
            400, b"Bad Request",
            "the request is not valid HTTP/1.1 (a malformed request line or header, or a URL"
            " that is too long)",
            "invalid_http_request",
        )  # fmt: skip

    def _head_too_large(self) -> None:
        self._refuse(
            431, b"Request Header Fields Too Large",
            f"the request line and headers are larger than {MAX_HEAD_BYTES} bytes",
            "request_headers_too_large",
        )  # fmt: skip

    def _refuse(self, status: int, reason: bytes, message: str, code: str) -> None:
        """Answer ``status`` with an OpenAI-style error body and close the connection."""
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": code,
                }
            }
        ).encode()
        rid = new_request_id().encode()
        head = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"x-request-id: " + rid + b"\r\nx-hotpool-request-id: " + rid + b"\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
        self._head_bytes = None
        self.transport.write(b"".join(head))
        self.transport.close()
