"""The in-flight journal: the requests being served, on disk, so a crash cannot make them vanish.

A JSON-lines file ``inflight.<seq>.jsonl`` in the spool folder, one line per step of a
request's life:

- ``open``: request id, deployment, endpoint, tenant, API key id, client request id and
  start time, when the request starts;
- ``tokens``: its running token counts, at its first output token (with its prompt's
  tokens), then at most every ``every_tokens`` tokens or every ``every_s`` seconds,
  whichever comes first;
- ``end``: its final usage record, when it is submitted to the ledger writer;
- ``done``: request ids whose records are safe (in the database or the fsynced spool).

What one pass of the event loop journals is encoded and written at the end of that pass, in
one ``os.write`` to the page cache, which survives the process dying in any way, ``kill -9``
included. Why at the end of the pass: a burst of requests is admitted one after another in
one pass, and encoding and writing each one's line on its way in (~25 us) delayed every
request behind it on its way to the worker; at the end of the pass the lines go after the
burst, in one system call. A process killed within the pass loses that pass's lines only:
its new requests had reached no client yet (and their worker stops with the connection),
and a finished request's missing ``end`` leaves it billed from its last ``tokens`` line. A
request's first ``tokens`` line is the exception, written at once with what is pending:
its first token goes to the client within the same pass, and the line holds the prompt's
count.
``fsync`` runs in the background every ``sync_interval_s``, so a power loss or kernel crash
loses at most that much. Token counts are journalled in steps, so a crash under-bills a
request's output by less than ``every_tokens`` tokens (or one second of it), never its prompt
once its first token is out, and never over-bills it; a step of 1 would write a line per
token.

On start-up :meth:`recover` reads what a previous process left: a request with an ``end``
but no ``done`` yields that record, one without an ``end`` a ``partial`` record (``error``
if it had no output yet, as the invoker bills a request cut before its first token) with
its last known tokens. Files are compacted: after ``compact_after`` lines a new file starts
with the live requests, and the old one is removed once the new one is fsynced.

Everything but :meth:`sync` and :meth:`close` runs on the event loop's thread; they run in a
worker thread: :meth:`sync` only fsyncs and removes retired files, :meth:`close` runs once
the loop has flushed and nothing journals any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hotpool.billing.ledger import UsageRecord
from hotpool.platform.spool import (
    encode_lines,
    fsync_dir,
    open_for_append,
    read_json_lines,
    record_from_json,
    record_to_json,
    write_all,
)

log = logging.getLogger("hotpool.ledger")

RESTART_ERROR = "control plane restarted"


@dataclass(frozen=True)
class OpenRequest:
    """What the ledger needs to bill a request that the process never got to finish."""

    request_id: str
    deployment: str
    endpoint: str
    tenant_id: int
    api_key_id: int | None = None
    client_request_id: str | None = None
    started_at: float = field(default_factory=time.time)  # Unix time


@dataclass(slots=True)
class _Entry:
    opened: dict[str, Any] | None  # the ``open`` line
    prompt: int = 0
    completion: int = 0
    cached: int = 0
    at: float = 0.0  # Unix time of the last ``tokens`` line
    written: int = 0  # completion tokens in the last ``tokens`` line
    written_at: float = 0.0  # monotonic time of that line
    end: dict[str, Any] | None = None  # the final record, once submitted


class InflightJournal:
    def __init__(
        self,
        folder: Path,
        every_tokens: int = 16,
        every_s: float = 1.0,
        compact_after: int = 50_000,
    ) -> None:
        self.folder = folder
        self.every_tokens = every_tokens
        self.every_s = every_s
        self.compact_after = compact_after
        self._live: dict[str, _Entry] = {}
        self._fd: int | None = None
        self._path: Path | None = None
        self._old: list[Path] = []  # files of a previous process, removed by start()
        self._lines = 0  # written to the current file
        self._pending: list[dict[str, Any]] = []  # this loop pass's lines, not written yet
        self._dirty = False
        self._failed = False

    def __len__(self) -> int:
        return len(self._live)

    # -- start-up --------------------------------------------------------------------

    def recover(self) -> list[UsageRecord]:
        """The records of requests a previous process left unfinished (call before start)."""
        self._old = self._files()
        entries: dict[str, _Entry] = {}
        for path in self._old:
            for line in read_json_lines(path):
                try:
                    _apply(entries, line)
                except (KeyError, TypeError) as exc:
                    log.warning("%s: skipping a malformed line (%r): %r", path, exc, line)
        records = []
        for request_id, e in entries.items():
            try:
                records.append(_closing_record(e))
            except (ValueError, TypeError, KeyError) as exc:
                log.error("in-flight request %s cannot be billed: %s (%r)", request_id, exc, e)
        return records

    def start(self) -> None:
        """Open a fresh journal and drop the previous process's files: call once what
        :meth:`recover` returned is safe."""
        self.folder.mkdir(parents=True, exist_ok=True)
        files = self._files()
        seq = _seq(files[-1]) + 1 if files else 1
        self._path = self.folder / f"inflight.{seq:012d}.jsonl"
        self._fd = open_for_append(self._path)
        fsync_dir(self.folder)
        for path in self._old:
            path.unlink(missing_ok=True)
        if self._old:
            fsync_dir(self.folder)
        self._old = []

    # -- the request path ------------------------------------------------------------

    def open(self, req: OpenRequest) -> None:
        line = {
            "op": "open",
            "request_id": req.request_id,
            "deployment": req.deployment,
            "endpoint": req.endpoint,
            "tenant_id": req.tenant_id,
            "api_key_id": req.api_key_id,
            "client_request_id": req.client_request_id,
            "started_at": req.started_at,
        }
        self._live[req.request_id] = _Entry(line, at=req.started_at, written_at=time.monotonic())
        self._write([line])

    def progress(self, request_id: str, prompt: int, completion: int, cached: int) -> None:
        """The request's running token counts; journalled only every so many tokens."""
        e = self._live.get(request_id)
        if e is None or completion == e.written:
            return
        e.prompt, e.completion, e.cached = prompt, completion, cached
        # Called per token: only a clock read unless a line is due. The first tokens are
        # written at once: they carry the prompt's count, often most of what a request
        # costs, which a crash before the next line would otherwise leave unbilled.
        now = time.monotonic()
        first = not e.written
        if (
            first
            or completion - e.written >= self.every_tokens
            or now - e.written_at >= self.every_s
        ):
            e.written, e.written_at, e.at = completion, now, time.time()
            if first:
                # Written now, not at the end of the pass: the caller sends this token to
                # the client within the pass, and a kill -9 after the client has it must
                # still find the prompt's count here.
                self._pending.append(_tokens_line(request_id, e))
                self.flush()
            else:
                self._write([_tokens_line(request_id, e)])

    def end(self, record: UsageRecord, created_at: float) -> None:
        """The request's final record, until the ledger writer says it is safe."""
        line = {"op": "end", "record": record_to_json(record, created_at)}
        e = self._live.get(record.request_id)
        if e is None:
            e = self._live[record.request_id] = _Entry(None)
        e.end = line["record"]
        self._write([line])

    def done(self, request_ids: list[str]) -> None:
        """These requests' records are in the database or the fsynced spool."""
        ids = [r for r in request_ids if self._live.pop(r, None) is not None]
        if ids:
            self._write([{"op": "done", "request_ids": ids}])

    # -- background ------------------------------------------------------------------

    def compact_if_due(self) -> Path | None:
        """Start a new file with only the live requests when the current one is long; the
        retired file goes to :meth:`sync`, which removes it once the new one is on disk."""
        if self._fd is None or self._lines + len(self._pending) < self.compact_after:
            return None
        self.flush()  # into the old file: the snapshot below already reflects these lines
        old_fd, old_path = self._fd, self._path
        self._path = self.folder / f"inflight.{_seq(old_path) + 1:012d}.jsonl"  # type: ignore[arg-type]
        self._fd = open_for_append(self._path)
        self._lines = 0
        snapshot: list[dict[str, Any]] = []
        for request_id, e in self._live.items():
            if e.opened is not None:
                snapshot.append(e.opened)
                if e.completion or e.prompt:
                    snapshot.append(_tokens_line(request_id, e))
            if e.end is not None:
                snapshot.append({"op": "end", "record": e.end})
        self._pending = snapshot  # written now: sync() is about to remove the old file
        self.flush()
        os.close(old_fd)
        return old_path

    def sync(self, retired: Path | None = None) -> None:
        """fsync the journal (in a worker thread); then remove ``retired``."""
        fd = self._fd
        if fd is not None and (self._dirty or retired is not None):
            self._dirty = False
            os.fsync(fd)
        if retired is not None:
            fsync_dir(self.folder)
            retired.unlink(missing_ok=True)
            fsync_dir(self.folder)

    def close(self) -> None:
        """fsync and close; with nothing in flight the file goes (a clean stop leaves none)."""
        if self._fd is None:
            return
        self.flush()
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        if not self._live and self._path is not None:
            self._path.unlink(missing_ok=True)
            fsync_dir(self.folder)

    def _write(self, lines: list[dict[str, Any]]) -> None:
        """Journal ``lines``: at the end of this pass of the event loop (see the module's
        docstring), or at once when no loop runs here."""
        if self._fd is None or not lines:
            return
        first = not self._pending
        self._pending += lines
        if not first:
            return  # the flush is already due
        try:
            asyncio.get_running_loop().call_soon(self.flush)
        except RuntimeError:  # no event loop (start-up, shutdown, a thread): now
            self.flush()

    def flush(self) -> None:
        """Write what is pending now (one ``os.write``)."""
        lines, self._pending = self._pending, []
        if self._fd is None or not lines:
            return
        try:
            write_all(self._fd, encode_lines(lines))
        except OSError as exc:
            # Serving goes on; only what a crash would leave behind is at risk.
            if not self._failed:
                log.error("in-flight journal %s cannot be written: %s", self._path, exc)
            self._failed = True
            with contextlib.suppress(OSError):
                write_all(self._fd, b"\n")  # end a line the failed write may have torn
            return
        self._lines += len(lines)
        self._dirty = True
        self._failed = False

    def _files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        found = (p for p in self.folder.glob("inflight.*.jsonl") if p.name.split(".")[1].isdigit())
        return sorted(found, key=_seq)


def _seq(path: Path) -> int:
    return int(path.name.split(".")[1])


def _tokens_line(request_id: str, e: _Entry) -> dict[str, Any]:
    return {
        "op": "tokens",
        "request_id": request_id,
        "prompt_tokens": e.prompt,
        "completion_tokens": e.completion,
        "cached_tokens": e.cached,
        "at": e.at,
    }


def _apply(entries: dict[str, _Entry], line: dict[str, Any]) -> None:
    op = line.get("op")
    if op == "open":
        entries[line["request_id"]] = _Entry(line, at=line["started_at"])
    elif op == "tokens" and (e := entries.get(line["request_id"])) is not None:
        e.prompt, e.completion = line["prompt_tokens"], line["completion_tokens"]
        e.cached, e.at = line["cached_tokens"], line["at"]
    elif op == "end":
        record = line["record"]
        entries.setdefault(record["request_id"], _Entry(None)).end = record
    elif op == "done":
        for request_id in line["request_ids"]:
            entries.pop(request_id, None)


def _closing_record(e: _Entry) -> UsageRecord:
    if e.end is not None:
        return record_from_json(e.end)
    o = e.opened
    if o is None:  # cannot happen: an entry is made by an ``open`` or an ``end`` line
        raise ValueError("neither an open nor an end line")
    return UsageRecord(
        request_id=o["request_id"],
        deployment=o["deployment"],
        endpoint=o["endpoint"],
        status="partial" if e.completion else "error",
        prompt_tokens=e.prompt,
        completion_tokens=e.completion,
        cached_tokens=min(e.cached, e.prompt),
        tenant_id=o["tenant_id"],
        total_seconds=max(0.0, e.at - o["started_at"]),
        error=RESTART_ERROR,
        created_at=datetime.fromtimestamp(e.at, UTC),
        api_key_id=o["api_key_id"],
        client_request_id=o["client_request_id"],
    )
