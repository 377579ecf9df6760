"""Alembic environment for hotpool's ledger.

There is no alembic.ini: :class:`hotpool.billing.db.Database` builds the Alembic config in
code, so migrations run the same from a checkout and from an installed wheel. A caller that
already holds a connection passes it as ``config.attributes["connection"]``; otherwise the
URL in ``sqlalchemy.url`` is used.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine, pool

from hotpool.billing.models import Base

target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode recreates the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=bool(url and url.startswith("sqlite")),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database: set sqlalchemy.url or attributes['connection']")
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            _configure(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
