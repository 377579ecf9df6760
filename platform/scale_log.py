"""Scale events leave the pool through a queue and reach SQL off the event loop.

A scale-up is stored when it is decided; its cold-start seconds (or why it failed) are
filled in when the replica is ready. Operations run in order in one task, so the update
always finds its row. Like the ledger writer, ``submit`` never blocks or awaits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from hotpool.billing.models import utcnow
from hotpool.billing.scale_events import ScaleEventRecord, ScaleEventStore
from hotpool.pool.pool import ScaleEvent
from hotpool.pool.replica import Replica

log = logging.getLogger("hotpool.scale_events")


@dataclass(frozen=True)
class _Stamped:
    """A scale event with its deployment's tenant and its time, taken when it happened: the
    deployment may be deleted and its name taken (by another tenant too) before it is
    stored."""

    event: ScaleEvent
    tenant_id: int | None
    at: datetime


@dataclass(frozen=True)
class _ColdStartDone:
    replica_id: str
    seconds: float | None
    error: str | None
    phases: Mapping[str, float] | None


class ScaleEventWriter:
    def __init__(
        self, store: ScaleEventStore, tenant_of: Callable[[str], int | None] = lambda _: None
    ) -> None:
        self.store = store
        self.tenant_of = tenant_of
        # A deployment's tenant, as last seen: its scale-downs after a DELETE, when the
        # catalog no longer knows it, still belong to it.
        self._tenants: dict[str, int] = {}
        self._queue: asyncio.Queue[_Stamped | _ColdStartDone] = asyncio.Queue()
        self._rows: dict[str, int] = {}  # replica id -> its scale-up row, until it is ready
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scale-event-writer")

    def submit(self, event: ScaleEvent) -> None:
        self._queue.put_nowait(_Stamped(event, self._tenant(event.deployment), utcnow()))

    def cold_start_done(self, replica: Replica) -> None:
        self._queue.put_nowait(
            _ColdStartDone(
                replica.id,
                replica.cold_start_seconds,
                replica.error,
                dict(replica.load.phases) if replica.load else None,
            )
        )

    async def flush(self) -> None:
        await self._queue.join()

    async def close(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            op = await self._queue.get()
            try:
                await asyncio.to_thread(self._apply, op)
            except Exception:
                # Scale events are for the dashboard, not billing: log and go on.
                log.exception("could not store scale event %s", op)
            finally:
                self._queue.task_done()

    def _apply(self, item: _Stamped | _ColdStartDone) -> None:
        if isinstance(item, _ColdStartDone):
            row = self._rows.pop(item.replica_id, None)
            if row is not None:
                self.store.set_cold_start(row, item.seconds, item.error, item.phases)
            return
        op = item.event
        row = self.store.record(
            ScaleEventRecord(
                deployment=op.deployment,
                from_replicas=op.from_replicas,
                to_replicas=op.to_replicas,
                reason=op.reason[:256],
                created_at=item.at,
                tenant_id=item.tenant_id,
            )
        )
        if op.to_replicas > op.from_replicas and op.replica_id is not None:
            self._rows[op.replica_id] = row
        elif op.replica_id is not None:
            self._rows.pop(op.replica_id, None)  # removed before it was ever ready

    def _tenant(self, deployment: str) -> int | None:
        tenant = self.tenant_of(deployment)
        if tenant is None:
            return self._tenants.get(deployment)
        self._tenants[deployment] = tenant
        return tenant
