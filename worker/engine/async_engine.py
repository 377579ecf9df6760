"""Drive an :class:`Engine` from one background thread and stream its outputs to asyncio.

The HTTP server lives on an event loop; the engine's steps are long, blocking torch calls.
One thread owns the engine (engines are not thread-safe); callers hand it work through a
queue of operations and get outputs back on per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from hotpool.worker.engine.base import Engine, EngineRequest, RequestOutput

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The engine loop has stopped; no more requests can run on this replica."""


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        _hand_over(self.loop, self.queue.put_nowait, item)


def _hand_over(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    # A closed loop (RuntimeError) has nobody waiting for these any more, and the engine
    # thread must not die of it: the other loops' requests go on.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._ops: list[Callable[[], None]] = []
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def num_active(self) -> int:
        """Requests in flight (a request of n choices counts once)."""
        return len({id(s) for s in self._streams.values()})

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Yield one :class:`RequestOutput` per step until the request finishes.

        Leaving the iterator early (client gone, stop string found) aborts the request.
        """
        return self.generate_many((request,))

    async def generate_many(
        self, requests: Sequence[EngineRequest]
    ) -> AsyncIterator[RequestOutput]:
        """The outputs of several requests (the n choices of one prompt), interleaved as the
        steps produce them, until all have finished.

        They are added in one go, so they are admitted together and share the prompt's
        prefix-cache blocks. A rejection of any raises before any output; leaving the
        iterator early aborts those still running.
        """
        stream = _Stream(asyncio.get_running_loop())
        ids = [r.request_id for r in requests]
        for rid in ids:
            self._streams[rid] = stream

        def add() -> None:
            for r in requests:
                self._add(r, stream)

        self._submit(add)
        unfinished = set(ids)
        try:
            while unfinished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.request_id not in unfinished:
                    continue  # an abort that raced the request's own finish
                if item.finished:
                    unfinished.discard(item.request_id)
                yield item
        finally:
            for rid in ids:
                self._streams.pop(rid, None)
            if unfinished:
                left = tuple(unfinished)

                def abort() -> None:
                    for rid in left:
                        self.engine.abort(rid)

                self._submit(abort)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its stream ends with ``finish_reason="abort"``."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False

        def op() -> None:
            self.engine.abort(request_id)
            stream.put(RequestOutput(request_id, (), "abort", 0))

        self._submit(op)
        return True

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _add(self, request: EngineRequest, stream: _Stream) -> None:
        try:
            self.engine.add_request(request)
        except Exception as exc:  # rejected: tell that caller only
            stream.put(exc)

    def _submit(self, op: Callable[[], None]) -> None:
        with self._cond:
            if self._stopped:
                raise EngineDead("the engine is shut down")
            self._ops.append(op)
            self._cond.notify()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their event loops: one wake-up per loop and step, not
        one per output (each ``call_soon_threadsafe`` writes to the loop's self-pipe, a
        system call made while the loop thread waits for this one's GIL)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, out))
        for loop, items in batches.items():
            _hand_over(loop, _deliver, items)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self._ops and not self.engine.has_unfinished():
                    self._cond.wait()
                if self._stopped:
                    break
                ops, self._ops = self._ops, []
            for op in ops:
                op()
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails the requests in it, not the worker
                log.exception("engine step failed")
                self.engine.fail_all()  # and the prefixes its pass may have left garbage in
                for stream in list(self._streams.values()):
                    stream.put(exc)
                continue
            self._publish(outputs)
        err = EngineDead("the engine was shut down")
        for stream in self._streams.values():
            stream.put(err)
