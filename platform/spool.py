"""A durable local spool for usage records the database could not take.

One JSON object per line, one :class:`UsageRecord` each (``created_at`` in ISO 8601). New
records are appended to ``usage.jsonl``; an append counts as safe only once it is written
and ``os.fsync``-ed. A replay first *seals* the active file (renames it to
``usage.<seq>.jsonl`` and fsyncs the folder), so records appended while the replay runs go
to a fresh file and are never removed with it; a sealed segment is deleted only after every
record in it is in the database. A crash can tear the last line of a file: readers skip a
line that does not parse, and the next append starts on a line of its own.

Records the database refuses on their own (a constraint they break) are kept in
``rejected.jsonl`` with the error, for an operator, instead of wedging the replay.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hotpool.billing.ledger import UsageRecord

log = logging.getLogger("hotpool.ledger")

ACTIVE = "usage.jsonl"
REJECTED = "rejected.jsonl"
_FIELDS = tuple(f.name for f in fields(UsageRecord))


def record_to_json(rec: UsageRecord, created_at: float | None = None) -> dict[str, Any]:
    """``rec`` as a JSON object; ``created_at`` (a Unix time) fills a record without one."""
    data = {name: getattr(rec, name) for name in _FIELDS}
    when = rec.created_at
    if when is None and created_at is not None:
        when = datetime.fromtimestamp(created_at, UTC)
    data["created_at"] = None if when is None else when.isoformat()
    return data


def record_from_json(data: dict[str, Any]) -> UsageRecord:
    """The inverse of :func:`record_to_json`; unknown keys are ignored, so a spool written
    by another version still reads. Raises ``ValueError`` or ``TypeError`` on a bad record."""
    values = {name: data[name] for name in _FIELDS if name in data}
    if values.get("created_at") is not None:
        values["created_at"] = datetime.fromisoformat(values["created_at"])
    return UsageRecord(**values)


def encode_lines(objs: Sequence[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(o, separators=(",", ":")) + "\n" for o in objs).encode()


def fsync_dir(folder: Path) -> None:
    """Make a create, rename or unlink in ``folder`` survive a power loss."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_for_append(path: Path) -> int:
    """An O_APPEND descriptor on ``path``; a torn last line left by a crash is ended first,
    so the next record does not glue onto it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    size = os.fstat(fd).st_size
    if size:
        with open(path, "rb") as f:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                write_all(fd, b"\n")
    return fd


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_json_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The objects of a JSON-lines file, skipping (and logging) lines that do not parse."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                torn = "a torn last line" if not line.endswith(b"\n") else "a torn line"
                log.warning("%s: skipping %s (line %d, %d bytes)", path, torn, number, len(line))
                continue
            if isinstance(obj, dict):
                yield obj


class UsageSpool:
    """The spool folder's usage files. Thread-safe: the ledger writer appends from one
    thread while its replayer seals and reads from another."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._fd: int | None = None

    @property
    def active(self) -> Path:
        return self.folder / ACTIVE

    def append(
        self, records: Sequence[UsageRecord], created_at: Sequence[float] | None = None
    ) -> None:
        """Append ``records`` and return once they are on disk (write + fsync).

        ``created_at`` (Unix times, one per record) stamps records that have none, so a
        replay bills them at their own time, not at the replay's."""
        if not records:
            return
        stamps = created_at or [None] * len(records)
        data = encode_lines([record_to_json(r, t) for r, t in zip(records, stamps, strict=True)])
        with self._lock:
            if self._fd is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                created = not self.active.exists()
                self._fd = open_for_append(self.active)
                if created:
                    fsync_dir(self.folder)
            try:
                write_all(self._fd, data)
                os.fsync(self._fd)
            except OSError:
                # Reopened next time, which ends a line this write may have torn.
                os.close(self._fd)
                self._fd = None
                raise

    def has_records(self) -> bool:
        """Whether anything waits for a replay (in the active file or a sealed one)."""
        with self._lock:
            if self.active.exists() and self.active.stat().st_size > 0:
                return True
        return bool(self.sealed())

    def seal(self) -> list[Path]:
        """Seal the active file and return every sealed segment, oldest first."""
        with self._lock:
            if self.active.exists() and self.active.stat().st_size > 0:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
                segments = self.sealed()
                # Microseconds: names keep growing even after older segments are removed.
                seq = max(_seq(segments[-1]) + 1 if segments else 0, time.time_ns() // 1000)
                os.rename(self.active, self.folder / f"usage.{seq:016d}.jsonl")
                fsync_dir(self.folder)
        return self.sealed()

    def sealed(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        found = (p for p in self.folder.glob("usage.*.jsonl") if p.name.split(".")[1].isdigit())
        return sorted(found, key=_seq)

    def read(self, segment: Path, chunk: int = 2000) -> Iterator[list[UsageRecord]]:
        """The records of ``segment`` in chunks; an invalid record is kept as rejected."""
        batch: list[UsageRecord] = []
        for obj in read_json_lines(segment):
            try:
                batch.append(record_from_json(obj))
            except (ValueError, TypeError, KeyError) as exc:
                self.reject(obj, f"invalid record: {exc}")
                continue
            if len(batch) >= chunk:
                yield batch
                batch = []
        if batch:
            yield batch

    def remove(self, segment: Path) -> None:
        """Delete a sealed segment whose every record is in the database."""
        segment.unlink(missing_ok=True)
        fsync_dir(self.folder)

    def reject(self, obj: dict[str, Any] | UsageRecord, error: str) -> None:
        """Keep a record the database refuses, with why, out of the replay's way."""
        data = record_to_json(obj) if isinstance(obj, UsageRecord) else obj
        log.error("ledger refused a usage record (kept in %s): %s", REJECTED, error)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = open_for_append(self.folder / REJECTED)
        try:
            write_all(fd, encode_lines([{"record": data, "error": error}]))
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _seq(segment: Path) -> int:
    return int(segment.name.split(".")[1])
