"""Usage records leave the request path through a queue and reach SQL in batches, losing
nothing whatever fails.

The request path only calls :meth:`LedgerWriter.begin`, :meth:`~LedgerWriter.progress`
and :meth:`~LedgerWriter.submit`: none blocks or awaits (each is a few microseconds of
in-memory work and, with a spool folder, one ``write`` to the in-flight journal), so they
are safe in a cancelled request's cleanup.

With a spool folder (``HOTPOOL_SPOOL_DIR``):

- a batch the database does not take (unreachable, erroring, or silent past
  ``db_timeout_s``) is appended to the durable spool (:mod:`hotpool.platform.spool`,
  fsynced) and the writer goes on; while the database is down, batches go straight there;
- a replayer moves the spool back into the database when it answers again. The ledger's
  insert is idempotent by ``request_id``, so replaying a record that did reach the database
  (a timed-out insert that committed after all, a crash mid-replay) records nothing twice;
- the in-flight journal (:mod:`hotpool.platform.inflight`) holds every request from its start
  to the moment its record is safe, so a ``kill -9`` loses neither a running request (closed
  as ``partial`` at the next start) nor a finished one still queued here;
- ``start`` bills what a previous process left in the journal and replays its spool;
  ``close`` flushes the queue to the database, or to the spool if it is down.

Without one (tests, benchmarks) a failed batch is retried in memory with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path

from sqlalchemy.exc import DataError, IntegrityError

from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.platform.inflight import InflightJournal, OpenRequest
from hotpool.platform.spool import UsageSpool

log = logging.getLogger("hotpool.ledger")

_Item = tuple[UsageRecord, float]  # a record and when it was submitted (Unix time)


class SpoolUnavailable(RuntimeError):
    """The spool folder cannot be used: another process holds it, or it is not writable."""


def lock_spool(folder: Path) -> int:
    """Take the spool folder for this process (an flock, released when the returned file
    descriptor is closed): two control planes replaying one spool would bill twice."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SpoolUnavailable(
            f"another hotpool process uses the spool folder {folder}; "
            "give each control plane its own HOTPOOL_SPOOL_DIR"
        ) from None
    return fd


class LedgerWriter:
    def __init__(
        self,
        ledger: Ledger,
        spool_dir: Path | None = None,
        *,
        batch_size: int = 256,
        linger_s: float = 0.2,
        every_tokens: int = 16,
        db_timeout_s: float = 10.0,
        sync_interval_s: float = 0.2,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.ledger = ledger
        self.batch_size = batch_size
        self.linger_s = linger_s
        self.db_timeout_s = db_timeout_s
        self.sync_interval_s = sync_interval_s
        self.max_backoff_s = max_backoff_s
        self.spool = UsageSpool(spool_dir) if spool_dir is not None else None
        self.journal = InflightJournal(spool_dir, every_tokens) if spool_dir is not None else None
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # ends a linger early: a full batch, or a flush
        self._flushing = 0  # flush() calls waiting: no lingering meanwhile
        self._replay_lock = asyncio.Lock()
        self._db_ok = True  # False from a failed insert until one succeeds
        self._hung: set[asyncio.Future[int]] = set()  # inserts that timed out and still run
        self._lock_fd: int | None = None
        self.failures = 0  # database writes that failed
        self.spooled = 0  # records written to the spool
        self.replayed = 0  # records the replay inserted (not counting ones already there)
        self.rejected = 0  # records the database refused on their own (set aside)

    @property
    def database_up(self) -> bool:
        """False from a failed insert until one succeeds (records go to the spool meanwhile)."""
        return self._db_ok

    def spool_pending(self) -> bool:
        """Whether spooled records still wait for a replay into the database."""
        return self.spool is not None and self.spool.has_records()

    @property
    def running(self) -> bool:
        return bool(self._tasks) and not self._tasks[0].done()

    async def start(self) -> None:
        """Bill what a previous process left in flight, then start writing and replaying."""
        if self.spool is not None:
            try:
                await asyncio.to_thread(self._recover)
            except OSError as exc:
                raise SpoolUnavailable(
                    f"cannot use the spool folder {self.spool.folder} (HOTPOOL_SPOOL_DIR): {exc}"
                ) from exc
        self._tasks.append(asyncio.create_task(self._run(), name="ledger-writer"))
        if self.spool is not None:
            self._tasks.append(asyncio.create_task(self._replay_loop(), name="ledger-replay"))
            self._tasks.append(asyncio.create_task(self._sync_loop(), name="ledger-journal"))

    # -- the request path ------------------------------------------------------------

    def begin(self, request: OpenRequest) -> None:
        """A request starts generating: journal it until its record is safe."""
        if self.journal is not None:
            self.journal.open(request)

    def progress(self, request_id: str, prompt: int, completion: int, cached: int) -> None:
        """A running request's token counts so far (journalled every so many tokens)."""
        if self.journal is not None:
            self.journal.progress(request_id, prompt, completion, cached)

    def withdraw(self, request_id: str) -> None:
        """A request refused as invalid (a 400) before it generated anything: no record, as
        for every 400 the API's validation answers, and nothing left in the journal."""
        if self.journal is not None:
            self.journal.done([request_id])

    def submit(self, record: UsageRecord) -> None:
        now = time.time()
        if self.journal is not None:
            self.journal.end(record, now)
        self._queue.put_nowait((record, now))
        if self._queue.qsize() >= self.batch_size:
            self._wake.set()

    # -- lifecycle -------------------------------------------------------------------

    async def flush(self) -> None:
        """Wait until every submitted record is in the database or the spool."""
        self._flushing += 1
        self._wake.set()
        try:
            await self._queue.join()
        finally:
            self._flushing -= 1

    async def replay(self) -> bool:
        """Move the spool into the database now; True when nothing is left in it."""
        if self.spool is None:
            return True
        async with self._replay_lock:
            # Sealed segments first; the active file is sealed only once they are all in,
            # so a database that stays down does not leave a segment per attempt.
            while segments := await asyncio.to_thread(self._segments):
                for segment in segments:
                    if not await self._replay_segment(segment):
                        return False
        return True

    def _segments(self) -> list[Path]:
        assert self.spool is not None
        return self.spool.sealed() or self.spool.seal()

    async def _replay_segment(self, segment: Path) -> bool:
        assert self.spool is not None
        chunks, total, new = self.spool.read(segment), 0, 0
        try:
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                inserted = await self._insert([(r, 0.0) for r in chunk])
                if inserted is None:
                    return False
                total, new = total + len(chunk), new + inserted
                self.replayed += inserted
                if self._stop.is_set():  # stopping: the rest waits for the next start
                    return False
        finally:
            chunks.close()
        await asyncio.to_thread(self.spool.remove, segment)
        log.info("replayed %d spooled usage records (%d new) into the ledger", total, new)
        return True

    async def close(self) -> None:
        """Flush the queue (to the database, or the spool if it is down) and stop."""
        await self.flush()
        self._stop.set()
        if self._tasks:
            self._tasks[0].cancel()  # idle on an empty queue
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks.clear()
        if self.journal is not None:
            self.journal.flush()  # on the loop's thread, where lines are added
            await asyncio.to_thread(self.journal.close)
        if self.spool is not None:
            self.spool.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- the writer ------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            await self._linger()
            while len(batch) < self.batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._store(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _linger(self) -> None:
        # A transaction per record costs the control plane milliseconds of CPU (SQLAlchemy,
        # the price lookup, the commit), taken from the event loop that relays tokens: at
        # one request at a time that was most of its CPU. Waiting a moment for more records
        # makes one transaction of many. Nothing is at risk meanwhile: with a spool the
        # in-flight journal holds the record, and without one it was only in memory anyway.
        if self.linger_s <= 0 or self._flushing or self._queue.qsize() + 1 >= self.batch_size:
            return
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.linger_s)

    async def _store(self, batch: list[_Item]) -> None:
        try_db, delay = self._db_ok or self.spool is None, 0.1
        while True:
            if try_db and await self._insert(batch) is not None:
                break
            if self.spool is not None and await self._spool(batch):
                break
            await asyncio.sleep(delay)  # neither the database nor the disk takes it
            try_db, delay = True, min(delay * 2, 10.0)
        if self.journal is not None:
            self.journal.done([r.request_id for r, _ in batch])

    async def _spool(self, batch: list[_Item]) -> bool:
        assert self.spool is not None
        try:
            records, stamps = [r for r, _ in batch], [t for _, t in batch]
            await asyncio.to_thread(self.spool.append, records, stamps)
        except OSError:
            log.exception("cannot spool %d usage records; retrying", len(batch))
            return False
        self.spooled += len(batch)
        return True

    async def _insert(self, batch: list[_Item]) -> int | None:
        """Rows inserted, or None when the database did not take the batch."""
        if self._hung:  # a timed-out insert still holds a connection: the database is sick
            return None
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, self._record_many, batch)
        try:
            inserted = await asyncio.wait_for(asyncio.shield(fut), self.db_timeout_s)
        except (IntegrityError, DataError):
            return await self._insert_each(batch)
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                self._hung.add(fut)
                fut.add_done_callback(self._unhung)
            self._down(exc, len(batch))
            return None
        if not self._db_ok:
            log.info("the ledger database answers again")
        self._db_ok = True
        return inserted

    async def _insert_each(self, batch: list[_Item]) -> int | None:
        """One record at a time, so the one the database refuses is set aside alone."""
        inserted = 0
        for item in batch:
            try:
                inserted += await asyncio.to_thread(self._record_many, [item])
            except (IntegrityError, DataError) as exc:
                self.rejected += 1
                if self.spool is not None:
                    await asyncio.to_thread(self.spool.reject, item[0], str(exc.orig))
                else:
                    log.error("the ledger refused %r: %s", item[0], exc.orig)
            except Exception as exc:
                self._down(exc, len(batch))
                return None
        return inserted

    def _unhung(self, fut: asyncio.Future[int]) -> None:
        self._hung.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.info("a timed-out ledger write failed after all: %r", fut.exception())

    def _down(self, exc: BaseException, n: int) -> None:
        self.failures += 1
        where = "spooling" if self.spool is not None else "retrying"
        if self._db_ok:
            log.warning("ledger write of %d records failed (%r); %s", n, exc, where)
        self._db_ok = False

    def _record_many(self, batch: list[_Item]) -> int:
        # A record without created_at gets the insert's time: ms after its submit here,
        # whereas the spool keeps the submit time (a replay may come much later).
        return self.ledger.record_many([r for r, _ in batch])

    # -- background ------------------------------------------------------------------

    def _recover(self) -> None:
        assert self.spool is not None and self.journal is not None
        self._lock_fd = lock_spool(self.spool.folder)
        records = self.journal.recover()
        if records:
            self.spool.append(records)  # safe before the journal that held them goes
            cut = sum(r.status != "completed" for r in records)
            log.warning(
                "billing %d requests a previous process left unrecorded (%d cut short)",
                len(records), cut,
            )  # fmt: skip
        self.journal.start()

    async def _replay_loop(self) -> None:
        assert self.spool is not None
        first = delay = min(0.25, self.max_backoff_s)
        while not self._stop.is_set():
            wait = 1.0
            if await asyncio.to_thread(self.spool.has_records):
                try:
                    if await self.replay():
                        delay = first
                        continue
                except OSError:
                    log.exception("cannot read the usage spool")
                wait, delay = delay, min(delay * 2, self.max_backoff_s)
            await self._sleep(wait)

    async def _sync_loop(self) -> None:
        assert self.journal is not None
        while not self._stop.is_set():
            await self._sleep(self.sync_interval_s)
            retired = self.journal.compact_if_due()
            try:
                await asyncio.to_thread(self.journal.sync, retired)
            except OSError:
                log.exception("cannot fsync the in-flight journal")

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
