"""Usage records leave the request path through a queue and reach SQL in batches.

``submit`` never blocks and never awaits, so it is safe in a cancelled request's cleanup.
A failed batch is retried with backoff; ``close`` flushes what is queued. (A durable spool
for a database that stays down is issue 8.)
"""

from __future__ import annotations

import asyncio
import logging

from hotpool.billing.ledger import Ledger, UsageRecord

log = logging.getLogger("hotpool.ledger")


class LedgerWriter:
    def __init__(self, ledger: Ledger, batch_size: int = 256) -> None:
        self.ledger = ledger
        self.batch_size = batch_size
        self._queue: asyncio.Queue[UsageRecord] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.failures = 0

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ledger-writer")

    def submit(self, record: UsageRecord) -> None:
        self._queue.put_nowait(record)

    async def flush(self) -> None:
        await self._queue.join()

    async def close(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            delay = 0.1
            while True:
                try:
                    await asyncio.to_thread(self.ledger.record_many, batch)
                    break
                except Exception:
                    self.failures += 1
                    log.exception(
                        "ledger write of %d records failed; retrying in %.1fs", len(batch), delay
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)
            for _ in batch:
                self._queue.task_done()
