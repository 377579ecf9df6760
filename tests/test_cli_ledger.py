"""``hotpool ledger``, run in-process against the SQLite ledger of a temporary HOTPOOL_HOME."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cli_runner import invoke
from click.testing import CliRunner
from sqlalchemy import text

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord

H0 = datetime(2025, 3, 1, 10, tzinfo=UTC)


@pytest.fixture
def db(run: CliRunner, home: Path) -> Iterator[Database]:
    """The CLI's own ledger, migrated, read and written directly."""
    assert invoke(run, "db", "upgrade").exit_code == 0
    database = Database(f"sqlite:///{home / 'hotpool.db'}")
    try:
        yield database
    finally:
        database.dispose()


def _record(db: Database, request_id: str, at: datetime) -> None:
    Ledger(db).record(UsageRecord(request_id, "m", "completions", "completed", 3, 4, created_at=at))


def test_rollup_then_check_is_ok(run: CliRunner, db: Database) -> None:
    _record(db, "r1", H0)
    _record(db, "r2", H0.replace(hour=12))
    result = invoke(run, "ledger", "rollup")
    assert (result.exit_code, result.stdout) == (0, "2 rollup rows written\n")
    result = invoke(run, "ledger", "check")
    assert (result.exit_code, result.stdout) == (0, "OK\n")


def test_check_lists_mismatches_and_exits_1(run: CliRunner, db: Database) -> None:
    _record(db, "r1", H0)
    assert invoke(run, "ledger", "rollup").exit_code == 0
    _record(db, "r2", H0.replace(minute=30))
    _record(db, "r3", H0.replace(hour=13))
    result = invoke(run, "ledger", "check")
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        "2025-03-01 10:00 UTC tenant 1 m: requests is 1 in the rollup, 2 in events",
        "2025-03-01 10:00 UTC tenant 1 m: prompt_tokens is 3 in the rollup, 6 in events",
        "2025-03-01 10:00 UTC tenant 1 m: completion_tokens is 4 in the rollup, 8 in events",
        "2025-03-01 13:00 UTC tenant 1 m: no rollup, events have 1 requests",
    ]


def test_rollup_of_a_range_rebuilds_only_its_hours(run: CliRunner, db: Database) -> None:
    _record(db, "r1", H0)
    _record(db, "r2", H0.replace(hour=12))
    # --since without an offset is UTC; the hour holding it is rebuilt whole.
    result = invoke(run, "ledger", "rollup", "--since", "2025-03-01T11:30", "--until", "2025-03-02")
    assert result.stdout == "1 rollup rows written\n"
    with db.engine.connect() as conn:
        hours = conn.execute(text("SELECT hour FROM usage_rollups_hourly")).scalars().all()
    assert [h[:13] for h in hours] == ["2025-03-01 12"]
    assert invoke(run, "ledger", "check").exit_code == 1
    result = invoke(run, "ledger", "rollup", "--until", "2025-03-01T12:00+01:00")
    assert result.stdout == "1 rollup rows written\n"
    assert invoke(run, "ledger", "check").stdout == "OK\n"


def test_rollup_refuses_bad_times(run: CliRunner) -> None:
    result = invoke(run, "ledger", "rollup", "--since", "yesterday")
    assert result.exit_code == 2
    assert "not an ISO 8601 time" in result.stderr
    result = invoke(run, "ledger", "rollup", "--since", "2025-03-02", "--until", "2025-03-01")
    assert result.exit_code == 2
    assert "must be after --since" in result.stderr


def test_ledger_help_names_its_commands(run: CliRunner) -> None:
    result = invoke(run, "ledger", "--help")
    assert result.exit_code == 0
    assert "rollup" in result.stdout and "check" in result.stdout
    assert "  ledger " in invoke(run, "--help").stdout
