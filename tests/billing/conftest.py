"""Fixtures that run every billing test on SQLite and on PostgreSQL.

PostgreSQL: one database ``hotpool_test_<random>`` per session on the server of
``HOTPOOL_TEST_POSTGRES_URL`` (default: the local server's ``test`` database, which is only
used to CREATE and DROP it); each test starts from an empty ``public`` schema. An unreachable
server fails the run with a clear message unless ``HOTPOOL_TEST_SKIP_POSTGRES=1``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, pool, text
from sqlalchemy.exc import OperationalError

from hotpool.billing.db import Database

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from scratch_postgres import fresh_database

DEFAULT_POSTGRES_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    """The URL of an existing database on the test server, reachable or the run fails."""
    url = os.environ.get("HOTPOOL_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    if os.environ.get("HOTPOOL_TEST_SKIP_POSTGRES") == "1":
        pytest.skip("HOTPOOL_TEST_SKIP_POSTGRES=1")
    engine = create_engine(url, poolclass=pool.NullPool, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        error = None
    except OperationalError as exc:
        error = str(exc.orig).strip()
    finally:
        engine.dispose()
    if error is not None:
        # Outside the except block, so the report is this message and not a traceback.
        pytest.fail(
            f"PostgreSQL is unreachable at {make_url(url)!r}: {error}. Start it, point "
            "HOTPOOL_TEST_POSTGRES_URL at one, or set HOTPOOL_TEST_SKIP_POSTGRES=1 to skip "
            "the postgres tests (or deselect them with -m 'not postgres').",
            pytrace=False,
        )
    return url


@pytest.fixture(scope="session")
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh database for this session, dropped at the end."""
    with fresh_database(postgres_admin_url, "hotpool_test") as url:
        yield url


def _reset_schema(url: str) -> None:
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty database: a SQLite file, or the session's PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'data' / 'hotpool.db'}"
    url: str = request.getfixturevalue("postgres_url")
    _reset_schema(url)
    return url


@pytest.fixture
def empty_db(db_url: str) -> Iterator[Database]:
    """A Database on an empty schema (no migration run)."""
    database = Database(db_url)
    try:
        yield database
    finally:
        database.dispose()


@pytest.fixture
def db(empty_db: Database) -> Database:
    """A Database migrated to the latest revision."""
    empty_db.upgrade()
    return empty_db
