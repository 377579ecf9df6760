"""A TCP proxy on loopback that a test or a benchmark can cut (a database that went away)
or freeze (a database that hangs): what the ledger-outage tests and benchmarks/chaos.py put
between ``hotpool serve`` and PostgreSQL, so they take *their* database away and not the
server other runs use."""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream``. :meth:`cut` drops every connection and
    refuses new ones (as a database that went away) until :meth:`restore`."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.up = True
        self.refused = 0
        self.frozen = threading.Event()  # clear: frozen
        self.frozen.set()
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self.up = False
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            _kill(s)

    def restore(self) -> None:
        self.up = True

    def freeze(self) -> None:
        """Hold every byte either way, and let new connections in to hang (as a database
        process that is stopped, not gone: the client's reads wait, nothing is refused)."""
        self.frozen.clear()

    def thaw(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        self.cut()
        _kill(self.listener)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if not self.up:
                self.refused += 1
                _kill(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _kill(client)
                continue
            with self._lock:
                self._socks |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.frozen.wait()
                dst.sendall(data)
        except OSError:
            pass
        _kill(src)
        _kill(dst)


def _kill(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv, unlike close()
    s.close()
