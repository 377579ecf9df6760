from __future__ import annotations

import io
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select, text

from hotpool.billing.db import Database, migrations_dir
from hotpool.billing.models import Base, Tenant

LEDGER_TABLES = {"tenants", "api_keys", "deployments", "usage_events", "scale_events"}
HEAD = "0003"


def _tables(db: Database) -> set[str]:
    return set(inspect(db.engine).get_table_names())


def test_upgrade_downgrade_upgrade_round_trip(empty_db: Database) -> None:
    assert empty_db.current_revision() is None

    empty_db.upgrade()
    assert empty_db.current_revision() == HEAD
    assert _tables(empty_db) == LEDGER_TABLES | {"alembic_version"}

    empty_db.downgrade("base")
    assert empty_db.current_revision() is None
    assert _tables(empty_db) & LEDGER_TABLES == set()

    empty_db.upgrade()
    assert empty_db.current_revision() == HEAD
    with empty_db.session() as session:
        assert session.scalars(select(Tenant.name)).all() == ["default"]


def test_downgrade_to_0001_drops_only_scale_events_and_api_keys(db: Database) -> None:
    db.downgrade("0001")
    assert db.current_revision() == "0001"
    assert _tables(db) == (LEDGER_TABLES - {"scale_events", "api_keys"}) | {"alembic_version"}
    db.upgrade()
    assert {"scale_events", "api_keys"} <= _tables(db)


def test_upgrade_twice_is_a_no_op(db: Database) -> None:
    db.upgrade()
    assert db.current_revision() == HEAD


def test_default_tenant_exists_and_next_tenant_gets_a_fresh_id(db: Database) -> None:
    with db.session() as session, session.begin():
        default = session.get(Tenant, 1)
        assert default is not None
        assert default.name == "default"
        assert default.created_at.tzinfo is UTC
        assert abs((datetime.now(UTC) - default.created_at).total_seconds()) < 60
        # On PostgreSQL the migration must have advanced the id sequence past 1.
        acme = Tenant(name="acme")
        session.add(acme)
    assert acme.id == 2


def test_models_and_migrations_agree(db: Database) -> None:
    with db.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_constraint_names_follow_the_convention(db: Database) -> None:
    insp = inspect(db.engine)
    assert {uq["name"] for uq in insp.get_unique_constraints("usage_events")} == {
        "uq_usage_events_request_id"
    }
    # PostgreSQL also lists the unique constraint's own index; that one is not ours.
    indexes = insp.get_indexes("usage_events")
    assert {ix["name"] for ix in indexes if not ix.get("duplicates_constraint")} == {
        "ix_usage_events_created_at",
        "ix_usage_events_deployment_created_at",
        "ix_usage_events_tenant_id",
    }
    assert {fk["name"] for fk in insp.get_foreign_keys("deployments")} == {
        "fk_deployments_tenant_id_tenants"
    }
    assert "ck_usage_events_cached_le_prompt" in {
        ck["name"] for ck in insp.get_check_constraints("usage_events")
    }
    assert {ix["name"] for ix in insp.get_indexes("scale_events")} == {
        "ix_scale_events_deployment_created_at"
    }
    assert insp.get_foreign_keys("scale_events") == []
    assert {
        "ck_scale_events_from_replicas_nonnegative",
        "ck_scale_events_to_replicas_nonnegative",
        "ck_scale_events_replicas_changed",
    } <= {ck["name"] for ck in insp.get_check_constraints("scale_events")}


def test_env_uses_the_url_when_no_connection_is_passed(empty_db: Database) -> None:
    # The path `alembic`-style tooling takes: only sqlalchemy.url, no shared connection.
    command.upgrade(empty_db.alembic_config(), "head")
    assert empty_db.current_revision() == HEAD
    command.downgrade(empty_db.alembic_config(), "base")
    assert empty_db.current_revision() is None


def test_offline_mode_renders_sql(empty_db: Database) -> None:
    config = empty_db.alembic_config()
    config.output_buffer = io.StringIO()
    command.upgrade(config, "head", sql=True)
    sql = config.output_buffer.getvalue()
    assert "CREATE TABLE usage_events" in sql
    assert "CREATE TABLE scale_events" in sql
    assert "CREATE TABLE api_keys" in sql
    assert "INSERT INTO tenants" in sql
    assert empty_db.current_revision() is None  # nothing ran


def test_migrations_ship_inside_the_package() -> None:
    folder = migrations_dir()
    assert (folder / "env.py").is_file()
    assert (folder / "script.py.mako").is_file()
    assert (folder / "versions" / "0001_initial.py").is_file()
    assert (folder / "versions" / "0002_scale_events.py").is_file()
    assert (folder / "versions" / "0003_api_keys.py").is_file()
    script = ScriptDirectory(str(folder))
    assert script.get_heads() == [HEAD]


def test_sqlite_file_gets_its_folder_wal_and_foreign_keys(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "ledger.db"
    db = Database(f"sqlite:///{path}")
    try:
        assert db.is_sqlite
        db.upgrade()
        assert path.is_file()
        with db.engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 30_000
    finally:
        db.dispose()


def test_in_memory_sqlite_is_one_database_across_connections() -> None:
    db = Database("sqlite://")
    try:
        db.upgrade()
        with db.session() as session:
            assert session.get(Tenant, 1) is not None
    finally:
        db.dispose()
