"""The usage spool and the ledger writer: a database that fails loses nothing and doubles
nothing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import UsageEvent
from hotpool.platform.inflight import RESTART_ERROR
from hotpool.platform.ledger_writer import LedgerWriter, SpoolUnavailable
from hotpool.platform.spool import REJECTED, UsageSpool

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _rec(request_id: str, **overrides: Any) -> UsageRecord:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "deployment": "smollm2",
        "endpoint": "chat.completions",
        "status": "completed",
        "prompt_tokens": 12,
        "completion_tokens": 7,
        "created_at": T0,
    }
    return UsageRecord(**{**fields, **overrides})


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(f"sqlite:///{tmp_path / 'ledger.db'}")
    database.upgrade()
    yield database
    database.dispose()


def _rows(db: Database) -> dict[str, int]:
    """request_id -> how many rows it has."""
    with db.engine.connect() as conn:
        stmt = select(UsageEvent.request_id, func.count()).group_by(UsageEvent.request_id)
        return {r: n for r, n in conn.execute(stmt)}


class FlakyLedger(Ledger):
    """A ledger whose database is down for its first ``failures`` writes."""

    def __init__(self, db: Database, failures: int = 0, hang_s: float = 0.0) -> None:
        super().__init__(db)
        self.failures, self.hang_s, self.calls = failures, hang_s, 0

    def record_many(self, recs: Any) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise OperationalError("INSERT", {}, ConnectionRefusedError("database is down"))
        if self.hang_s:
            time.sleep(self.hang_s)
        return super().record_many(recs)


# -- the spool file ----------------------------------------------------------------------


def _read_all(spool: UsageSpool) -> list[UsageRecord]:
    """Every record in the spool, as a replay sees them; the segments are removed."""
    records = []
    for segment in spool.seal():
        records += [r for chunk in spool.read(segment) for r in chunk]
        spool.remove(segment)
    return records


def test_records_round_trip_through_the_spool_exactly(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path / "spool")
    east = timezone(timedelta(hours=2))
    recs = [
        _rec("a", cached_tokens=4, queue_seconds=0.25, ttft_seconds=1.5, cold_start=True),
        _rec("b", status="partial", error="stream cut", api_key_id=3, client_request_id="c-1"),
        _rec("c", created_at=datetime(2025, 3, 1, 14, 0, 0, 123456, tzinfo=east)),
    ]
    spool.append(recs)
    lines = spool.active.read_text().splitlines()  # one JSON object a line
    assert [json.loads(line)["request_id"] for line in lines] == ["a", "b", "c"]
    assert _read_all(spool) == recs  # every field, the time zone's offset included


def test_seal_moves_the_active_file_aside_and_appends_go_to_a_new_one(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    spool.append([_rec("a"), _rec("b")])
    [first] = spool.seal()
    spool.append([_rec("c")])  # during a replay of `first`
    assert spool.has_records()
    assert [r.request_id for chunk in spool.read(first) for r in chunk] == ["a", "b"]
    spool.remove(first)  # replayed: only the sealed segment goes
    [second] = spool.seal()
    assert second.name > first.name  # oldest first
    assert [r.request_id for chunk in spool.read(second) for r in chunk] == ["c"]
    spool.remove(second)
    assert not spool.has_records() and spool.seal() == []


def test_a_torn_last_line_is_skipped_and_the_next_append_starts_a_new_line(
    tmp_path: Path,
) -> None:
    spool = UsageSpool(tmp_path)
    spool.append([_rec("a")])
    spool.close()
    with open(spool.active, "ab") as f:  # a crash in the middle of a write
        f.write(b'{"request_id":"torn","deploym')
    assert [r.request_id for r in _read_all(UsageSpool(tmp_path))] == ["a"]

    spool = UsageSpool(tmp_path)
    spool.append([_rec("b")])
    with open(spool.active, "ab") as f:
        f.write(b'{"request_id":"torn-again"')
    spool2 = UsageSpool(tmp_path)
    spool2.append([_rec("c")])  # starts on a line of its own: "c" is not glued to the tear
    assert [r.request_id for r in _read_all(spool2)] == ["b", "c"]


def test_chunks_bound_what_a_replay_holds_in_memory(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    spool.append([_rec(f"r{i}") for i in range(25)])
    [segment] = spool.seal()
    assert [len(c) for c in spool.read(segment, chunk=10)] == [10, 10, 5]


# -- the writer --------------------------------------------------------------------------


async def _submit_all(writer: LedgerWriter, ids: list[str], every: int = 50) -> None:
    for i, request_id in enumerate(ids):
        writer.submit(_rec(request_id))
        if i % every == every - 1:
            await asyncio.sleep(0.01)  # let the writer take a batch, as live traffic would


async def _until(check: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_database_that_fails_then_recovers_ends_with_every_record_once(
    tmp_path: Path, db: Database
) -> None:
    ids = [f"req-{i}" for i in range(1000)]
    ledger = FlakyLedger(db, failures=6)

    async def scenario() -> LedgerWriter:
        writer = LedgerWriter(ledger, tmp_path / "spool", batch_size=40, max_backoff_s=0.1)
        await writer.start()
        await _submit_all(writer, ids)
        await writer.flush()  # in the database or the spool: nothing waits in memory
        await _until(lambda: not writer.spool.has_records())  # type: ignore[union-attr]
        await writer.close()
        return writer

    writer = asyncio.run(scenario())
    assert _rows(db) == dict.fromkeys(ids, 1)
    assert writer.failures == 6 and writer.spooled > 0 and writer.replayed == writer.spooled
    assert sorted(p.name for p in (tmp_path / "spool").iterdir()) == ["lock"]


def test_close_with_the_database_down_spools_and_the_next_start_replays(
    tmp_path: Path, db: Database
) -> None:
    async def down() -> LedgerWriter:
        writer = LedgerWriter(FlakyLedger(db, failures=10**6), tmp_path / "spool")
        await writer.start()
        await _submit_all(writer, [f"req-{i}" for i in range(300)])
        await writer.close()
        return writer

    assert asyncio.run(down()).spooled == 300
    assert _rows(db) == {}

    async def up() -> None:
        writer = LedgerWriter(Ledger(db), tmp_path / "spool")
        await writer.start()  # replays the previous process's spool
        await _until(lambda: len(_rows(db)) == 300)
        await writer.close()

    asyncio.run(up())
    assert _rows(db) == {f"req-{i}": 1 for i in range(300)}


def test_a_spooled_record_keeps_the_time_it_was_submitted_not_the_replays(
    tmp_path: Path, db: Database
) -> None:
    async def down() -> float:
        writer = LedgerWriter(FlakyLedger(db, failures=10**6), tmp_path / "spool")
        await writer.start()
        submitted = time.time()
        writer.submit(_rec("late", created_at=None))
        await writer.close()
        return submitted

    submitted = asyncio.run(down())
    time.sleep(1.5)  # the database is back only later

    async def up() -> None:
        writer = LedgerWriter(Ledger(db), tmp_path / "spool")
        await writer.start()
        await _until(lambda: "late" in _rows(db))
        await writer.close()

    asyncio.run(up())
    [row] = Ledger(db).events()
    assert row.created_at is not None
    assert abs(row.created_at.timestamp() - submitted) < 0.5  # priced at its own time


def test_a_timed_out_insert_that_commits_after_all_is_not_counted_twice(
    tmp_path: Path, db: Database
) -> None:
    async def scenario() -> LedgerWriter:
        ledger = FlakyLedger(db, hang_s=0.5)  # slow, and then it commits
        writer = LedgerWriter(ledger, tmp_path / "spool", db_timeout_s=0.1, max_backoff_s=0.1)
        await writer.start()
        writer.submit(_rec("slow"))
        await writer.flush()
        assert writer.spooled == 1  # given up on in time; safe in the spool
        ledger.hang_s = 0.0
        await _until(lambda: not writer.spool.has_records())  # type: ignore[union-attr]
        await writer.close()
        return writer

    writer = asyncio.run(scenario())
    assert _rows(db) == {"slow": 1}
    assert writer.replayed == 0  # the replay found it there already: a no-op


def test_replay_is_idempotent(tmp_path: Path, db: Database) -> None:
    Ledger(db).record_many([_rec("a"), _rec("b")])
    spool = UsageSpool(tmp_path / "spool")
    spool.append([_rec("a"), _rec("b"), _rec("c")])
    spool.append([_rec("c"), _rec("d")])  # a record spooled twice

    async def scenario() -> LedgerWriter:
        writer = LedgerWriter(Ledger(db), tmp_path / "spool")
        assert await writer.replay() is True
        writer.spool.append([_rec("a"), _rec("d")])  # type: ignore[union-attr]
        assert await writer.replay() is True
        return writer

    assert asyncio.run(scenario()).replayed == 2  # c and d; every other one was there
    assert _rows(db) == {"a": 1, "b": 1, "c": 1, "d": 1}


def test_a_record_the_database_refuses_is_set_aside_not_retried_forever(
    tmp_path: Path, db: Database
) -> None:
    async def scenario() -> None:
        writer = LedgerWriter(Ledger(db), tmp_path / "spool")
        await writer.start()
        for rec in (_rec("ok-1"), _rec("bad", tenant_id=999), _rec("ok-2")):
            writer.submit(rec)  # tenant 999 does not exist: a foreign key the row breaks
        await writer.close()

    asyncio.run(scenario())
    assert _rows(db) == {"ok-1": 1, "ok-2": 1}
    [kept] = (tmp_path / "spool" / REJECTED).read_text().splitlines()
    assert json.loads(kept)["record"]["request_id"] == "bad"


def test_two_writers_cannot_share_a_spool_folder(tmp_path: Path, db: Database) -> None:
    async def scenario() -> None:
        first = LedgerWriter(Ledger(db), tmp_path / "spool")
        await first.start()
        with pytest.raises(SpoolUnavailable, match="HOTPOOL_SPOOL_DIR"):
            await LedgerWriter(Ledger(db), tmp_path / "spool").start()
        await first.close()
        second = LedgerWriter(Ledger(db), tmp_path / "spool")  # free again
        await second.start()
        await second.close()
        (tmp_path / "file").touch()
        with pytest.raises(SpoolUnavailable, match="cannot use the spool folder"):
            await LedgerWriter(Ledger(db), tmp_path / "file" / "spool").start()

    asyncio.run(scenario())


# -- a crash -----------------------------------------------------------------------------

_CRASH = """
import asyncio, os, signal, sys, time
from pathlib import Path
from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.platform.inflight import OpenRequest
from hotpool.platform.ledger_writer import LedgerWriter

class Stuck(Ledger):  # the database never answers: records wait in the queue
    def record_many(self, recs):
        time.sleep(3600)

async def main():
    writer = LedgerWriter(Stuck(Database(sys.argv[1])), Path(sys.argv[2]), every_tokens=8)
    await writer.start()
    writer.begin(OpenRequest("running", "smollm2", "completions", 1, None, "client-1", 1e9))
    for n in range(1, 21):
        writer.progress("running", 9, n, 0)  # journalled at 1 (the first), 9 and 17
    writer.begin(OpenRequest("finished", "smollm2", "completions", 1))
    writer.submit(UsageRecord("finished", "smollm2", "completions", "completed", 9, 5))
    writer.begin(OpenRequest("queued", "smollm2", "completions", 1))
    await asyncio.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_requests_in_flight_at_a_kill_9_are_billed_at_the_next_start(
    tmp_path: Path, db: Database
) -> None:
    url = db.url.render_as_string(hide_password=False)
    code = textwrap.dedent(_CRASH)
    done = subprocess.run([sys.executable, "-c", code, url, str(tmp_path / "spool")], timeout=60)
    assert done.returncode == -9
    assert _rows(db) == {}

    async def restart() -> None:
        writer = LedgerWriter(Ledger(db), tmp_path / "spool")
        await writer.start()
        await _until(lambda: len(_rows(db)) == 3)
        await _until(lambda: not writer.spool.has_records())  # type: ignore[union-attr]
        await writer.close()

    asyncio.run(restart())
    events = {e.request_id: e for e in Ledger(db).events()}
    running = events["running"]
    assert (running.status, running.prompt_tokens, running.completion_tokens) == ("partial", 9, 17)
    assert running.error == RESTART_ERROR and running.client_request_id == "client-1"
    assert events["finished"].status == "completed" and events["finished"].completion_tokens == 5
    queued = events["queued"]  # started, no token yet: billed like a stream cut before one
    assert (queued.status, queued.completion_tokens, queued.error) == ("error", 0, RESTART_ERROR)
    # The journal starts over, empty, and a clean stop leaves none behind.
    assert [p.name for p in (tmp_path / "spool").iterdir()] == ["lock"]
    assert os.path.getsize(tmp_path / "spool" / "lock") == 0


def test_the_spool_folder_and_journal_step_are_settings(tmp_path: Path) -> None:
    from hotpool.settings import SettingsError, load_settings

    home = tmp_path.resolve()
    assert load_settings({"HOTPOOL_HOME": str(home)}).ledger_spool_dir == home / "spool"
    s = load_settings(
        {"HOTPOOL_HOME": str(home), "HOTPOOL_SPOOL_DIR": str(home / "s"),
         "HOTPOOL_INFLIGHT_EVERY_TOKENS": "4"}
    )  # fmt: skip
    assert (s.ledger_spool_dir, s.inflight_every_tokens) == (home / "s", 4)
    with pytest.raises(SettingsError, match="HOTPOOL_INFLIGHT_EVERY_TOKENS"):
        load_settings({"HOTPOOL_HOME": str(home), "HOTPOOL_INFLIGHT_EVERY_TOKENS": "0"})


def test_records_that_trickle_in_share_a_transaction_and_flush_does_not_wait(
    tmp_path: Path, db: Database
) -> None:
    """One request at a time, each record would be its own transaction (milliseconds of
    the control plane's CPU); the writer lingers a moment and writes them together."""
    ledger = FlakyLedger(db)

    async def scenario() -> tuple[int, float]:
        writer = LedgerWriter(ledger, tmp_path / "spool", linger_s=0.5)
        await writer.start()
        for i in range(10):  # one record every 10 ms, as requests finish one by one
            writer.submit(_rec(f"req-{i}"))
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await writer.flush()  # cuts the linger short
        took = time.monotonic() - t0
        await writer.close()
        return ledger.calls, took

    calls, flush_s = asyncio.run(scenario())
    assert _rows(db) == {f"req-{i}": 1 for i in range(10)}
    assert calls == 1  # ten records, one transaction
    assert flush_s < 0.4


def test_a_full_batch_is_written_without_lingering(tmp_path: Path, db: Database) -> None:
    ledger = FlakyLedger(db)

    async def scenario() -> None:
        writer = LedgerWriter(ledger, None, batch_size=5, linger_s=30.0)
        await writer.start()
        for i in range(5):
            writer.submit(_rec(f"req-{i}"))
        await _until(lambda: ledger.calls == 1, timeout_s=5.0)  # long before the 30 s
        await writer.close()

    asyncio.run(scenario())
    assert _rows(db) == {f"req-{i}": 1 for i in range(5)}
