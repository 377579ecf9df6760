"""The ledger's database: one engine, its sessions and its Alembic migrations.

SQLite (the embedded default) and PostgreSQL (production) go through the same code; the
only differences live here, in how connections are set up.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, create_engine, event, make_url, pool
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000

log = logging.getLogger("hotpool.ledger")


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """``logger`` at WARNING for the duration (its INFO lines are one step's detail)."""
    target = logging.getLogger(logger)
    level = target.level
    target.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        target.setLevel(level)


def migrations_dir() -> Path:
    """The folder of the installed ``hotpool.migrations`` package (Alembic's script location).

    Found without importing it: migrations import billing, not the other way round.
    """
    spec = find_spec("hotpool.migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package hotpool.migrations is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


class DatabaseUnavailable(RuntimeError):
    """The ledger's database cannot be opened or reached; the message says why in one line
    (what a command prints instead of a traceback)."""


DRIVERS = {"psycopg2": "postgresql+psycopg2://", "pymysql": "mysql+pymysql://"}


@contextlib.contextmanager
def explained(url: str) -> Iterator[None]:
    """Turns the ways a database URL fails, from parsing it to the first query, into
    :class:`DatabaseUnavailable`: a URL that does not parse, a dialect or driver that is
    not installed (SQLAlchemy takes plain ``postgresql://`` for psycopg 3, which hotpool
    does not ship), a server that does not answer. (A SQLite folder that cannot be made is
    one already: :class:`Database` raises it.)"""
    shown = _hide_password(url)
    try:
        yield
    except (NoSuchModuleError, ModuleNotFoundError) as exc:  # before its base, ArgumentError
        have = ", ".join(f"{prefix} ({d})" for d, prefix in DRIVERS.items() if find_spec(d))
        raise DatabaseUnavailable(
            f"HOTPOOL_DATABASE_URL {shown!r} needs a database driver that is not installed "
            f"({exc}); installed: {have or 'none'}"
        ) from None
    except ArgumentError:
        raise DatabaseUnavailable(
            f"HOTPOOL_DATABASE_URL {shown!r} is not a database URL (such as "
            "sqlite:////path/hotpool.db or postgresql+psycopg2://user:pass@host/db)"
        ) from None
    except OperationalError as exc:
        raise unreachable(exc, url) from None


def unreachable(exc: OperationalError, url: str) -> DatabaseUnavailable:
    """``exc`` (the server refused, went away, or the file cannot be opened) in one line."""
    lines = str(exc.orig or exc).strip().splitlines()
    reason = lines[0] if lines else type(exc.orig or exc).__name__
    return DatabaseUnavailable(f"cannot use the database {_hide_password(url)!r}: {reason}")


def _hide_password(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def _create_private(path: Path) -> None:
    """Create the SQLite file readable by its owner only, if it does not exist: it holds the
    API keys' hashes and every tenant's usage. SQLite gives its -wal and -shm files the
    database file's mode."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


class StaleSchema(RuntimeError):
    """The database is not at the latest revision (``hotpool db upgrade`` fixes it)."""

    def __init__(self, current: str | None, head: str | None) -> None:
        super().__init__(
            f"the database is at revision {current}, not {head}: run `hotpool db upgrade`"
        )


class Database:
    """An engine and session factory for a ledger at ``url`` (any SQLAlchemy URL).

    Creating one does not touch the schema; call :meth:`upgrade` to migrate to the latest
    revision. For a SQLite file the parent folder is created, and every connection gets WAL
    journaling (readers do not block the writer), foreign keys and a busy timeout so
    concurrent writers wait instead of failing with "database is locked".
    """

    def __init__(self, url: str, *, echo: bool = False) -> None:
        self.url = make_url(url)
        kwargs: dict[str, Any] = {"echo": echo}
        if self.is_sqlite:
            kwargs["connect_args"] = {
                "check_same_thread": False,
                "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000,
            }
            if self._sqlite_in_memory:
                # One shared connection, or each connection would see its own empty database.
                kwargs["poolclass"] = pool.StaticPool
            else:
                path = Path(self.url.database or "")
                folder = path.parent
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                    _create_private(path)
                except OSError as exc:  # HOTPOOL_HOME a file, a folder not writable...
                    raise DatabaseUnavailable(
                        f"cannot make the folder {folder} for the SQLite database: "
                        f"{exc.strerror or exc}"
                    ) from None
        else:
            kwargs["pool_pre_ping"] = True
        self.engine: Engine = create_engine(self.url, **kwargs)
        if self.is_sqlite:
            event.listen(self.engine, "connect", self._on_sqlite_connect)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def is_sqlite(self) -> bool:
        return self.url.get_backend_name() == "sqlite"

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"`` (the backend name, without the driver)."""
        return self.url.get_backend_name()

    @property
    def _sqlite_in_memory(self) -> bool:
        return self.url.database in (None, "", ":memory:")

    def _on_sqlite_connect(self, dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            if not self._sqlite_in_memory:
                cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        finally:
            cursor.close()

    def session(self) -> Session:
        """A new ORM session; use it as ``with db.session() as s, s.begin(): ...``."""
        return self._sessions()

    def insert(self, entity: Any) -> sqlite.Insert | postgresql.Insert:
        """The dialect's INSERT for ``entity``, which offers ``ON CONFLICT`` clauses."""
        if self.dialect == "sqlite":
            return sqlite.insert(entity)
        if self.dialect == "postgresql":
            return postgresql.insert(entity)
        raise NotImplementedError(f"hotpool supports sqlite and postgresql, not {self.dialect}")

    def alembic_config(self) -> Config:
        """An Alembic config for this database, built in code (there is no alembic.ini)."""
        config = Config()
        config.set_main_option("script_location", str(migrations_dir()))
        config.set_main_option("path_separator", "os")
        # ConfigParser interpolates '%'; URL-encoded passwords contain it.
        url = self.url.render_as_string(hide_password=False).replace("%", "%%")
        config.set_main_option("sqlalchemy.url", url)
        return config

    def upgrade(self, revision: str = "head") -> None:
        """Migrate the schema up to ``revision`` (default: the latest)."""
        self._run(command.upgrade, revision)

    def downgrade(self, revision: str) -> None:
        """Migrate the schema down to ``revision`` (``"base"`` drops every table)."""
        self._run(command.downgrade, revision)

    def _run(self, fn: Any, revision: str) -> None:
        config = self.alembic_config()
        with self.engine.begin() as connection:
            if self.is_sqlite:
                # pysqlite opens a transaction only before DML, so each DDL statement would
                # commit on its own and a failed migration would leave half a schema behind.
                # An explicit BEGIN makes the whole run one transaction (SQLite's DDL is
                # transactional); IMMEDIATE also makes concurrent migrators wait their turn.
                connection.exec_driver_sql("BEGIN IMMEDIATE")
            config.attributes["connection"] = connection
            fn(config, revision)

    def current_revision(self) -> str | None:
        """The revision the database is at, or None before the first migration."""
        with self.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()

    def head_revision(self) -> str | None:
        """The latest revision the migrations shipped with hotpool know."""
        from alembic.script import ScriptDirectory

        return ScriptDirectory.from_config(self.alembic_config()).get_current_head()

    def ensure_schema(self) -> None:
        """Make the schema current: SQLite is upgraded on the spot (an embedded ledger); a
        server database must be upgraded on purpose, so :class:`StaleSchema` says to."""
        if self.is_sqlite:
            with _quiet("alembic"):  # a line per migration, 16 for a new ledger: one says it
                before = self.current_revision()
                self.upgrade()
                after = self.current_revision()
            if before != after:
                what = f"from {before} to" if before else "created at"
                log.info("ledger database %s revision %s (%s)", what, after, self)
            return
        current, head = self.current_revision(), self.head_revision()
        if current != head:
            raise StaleSchema(current, head)

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    def __repr__(self) -> str:
        return f"Database({self.url.render_as_string(hide_password=True)!r})"
