"""uvicorn's HTTP protocol with corked writes, in two kinds.

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start``, and each body message in a write of its own. A token stream's
headers and first chunk are sent back to back, so the client was woken twice; on a small
machine the first wake-up lets the client's process take the core while the server still
has the first token to write (measured on the control plane: 0.24 ms at the median
between the two, 1.4 ms at p90, inside the time to first token).

- :class:`CorkedHttpToolsProtocol` (the worker): every write of one pass of the event loop
  is held and sent together at the end of the pass. On the worker's ``/generate/mux`` the
  events of every stream of a decode step leave in one ``send`` that way.
- :class:`HeadCorkedHttpToolsProtocol` (the control plane): a response head is held until
  the response's first body write, which takes it along (one system call, one wake-up), or
  until the end of the pass if no body comes in it; body writes go out at once. The control
  plane writes to many clients: in a pass that relays a decode step's tokens to 32 streams,
  holding every write to the end of the pass made the first stream's token wait for all 32
  streams' relay work (~1.5 ms at c=32).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# How every response head that uvicorn writes begins (its status lines; "100 Continue" too).
# A body write that happens to begin so is held to the end of the pass at worst, never lost.
_HEAD = b"HTTP/1.1 "


class CorkedTransport:
    """``transport``, with writes held: until the end of the event loop's pass
    (``whole_pass``), or only response heads, until the response's first body write."""

    def __init__(
        self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, whole_pass: bool = True
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._whole_pass = whole_pass
        self._parts: list[bytes] = []  # held, not written yet

    def write(self, data: bytes) -> None:
        if self._whole_pass or data.startswith(_HEAD):  # uvicorn writes a head whole
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


class CorkedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a :class:`CorkedTransport` (``Config(http=...)``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CorkedTransport(transport, self.loop))  # type: ignore[arg-type]


class HeadCorkedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with response heads held for their first body bytes."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        corked = CorkedTransport(transport, self.loop, whole_pass=False)
        super().connection_made(corked)  # type: ignore[arg-type]
