"""The scale-event writer stamps each event when it happens, not when SQL gets it (a real
SQLite store)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

from hotpool.billing.db import Database
from hotpool.billing.models import utcnow
from hotpool.billing.scale_events import ScaleEventStore
from hotpool.platform.scale_log import ScaleEventWriter
from hotpool.pool.pool import ScaleEvent


def test_an_event_keeps_the_tenant_and_time_it_happened_under(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'ledger.db'}")
    db.upgrade()
    owners = {"shared-name": 1}
    writer = ScaleEventWriter(ScaleEventStore(db), owners.get)

    async def run() -> None:
        before = utcnow()
        writer.submit(ScaleEvent("shared-name", 1, 0, "idle"))  # queued; not stored yet
        # Deleted and taken by another tenant before the writer gets to it:
        owners["shared-name"] = 2
        await asyncio.sleep(0.05)
        writer.start()
        await writer.close()
        (event,) = writer.store.list("shared-name")
        assert event.tenant_id == 1
        assert event.created_at is not None
        assert before <= event.created_at < before + timedelta(seconds=0.05)

    try:
        asyncio.run(run())
    finally:
        db.dispose()
