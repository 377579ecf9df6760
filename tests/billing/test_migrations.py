from __future__ import annotations

import io
import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select, text
from sqlalchemy.exc import IntegrityError

from hotpool.billing.db import Database, migrations_dir
from hotpool.billing.deployments import DeploymentSpec, DeploymentStore
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import Base, Tenant
from hotpool.billing.scale_events import ScaleEventStore

LEDGER_TABLES = {
    "tenants",
    "api_keys",
    "deployments",
    "usage_events",
    "scale_events",
    "prices",
    "usage_rollups_hourly",
    "deployment_versions",
}
HEAD = "0011"


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


def test_downgrade_to_0001_drops_only_the_later_tables(db: Database) -> None:
    later = {"scale_events", "api_keys", "prices", "usage_rollups_hourly", "deployment_versions"}
    db.downgrade("0001")
    assert db.current_revision() == "0001"
    assert _tables(db) == (LEDGER_TABLES - later) | {"alembic_version"}
    db.upgrade()
    assert later <= _tables(db)


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
        "ix_usage_events_corrects_id",
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
        "ix_scale_events_deployment_created_at",
        "ix_scale_events_tenant_id_created_at",
    }
    assert insp.get_foreign_keys("scale_events") == []
    assert {
        "ck_scale_events_from_replicas_nonnegative",
        "ck_scale_events_to_replicas_nonnegative",
        "ck_scale_events_replicas_changed",
    } <= {ck["name"] for ck in insp.get_check_constraints("scale_events")}


DEPLOYMENT_OPTIONS = {
    "max_queue",
    "queue_timeout_s",
    "dtype",
    "max_model_len",
    "kv_cache_bytes",
    "generation",
}
DEPLOYMENT_CHECKS = {
    "ck_deployments_max_queue_positive",
    "ck_deployments_queue_timeout_positive",
    "ck_deployments_dtype_valid",
    "ck_deployments_max_model_len_min",
    "ck_deployments_kv_cache_bytes_min",
    "ck_deployments_generation_positive",
}


def _columns(db: Database, table: str) -> set[str]:
    return {c["name"] for c in inspect(db.engine).get_columns(table)}


def test_migration_0004_up_and_down_keeps_deployments_and_usage(empty_db: Database) -> None:
    empty_db.upgrade("0003")
    with empty_db.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO deployments (name, tenant_id, snapshot_uri, min_replicas,"
            " max_replicas, target_concurrency, idle_timeout_s, created_at, updated_at)"
            " VALUES ('old', 1, 'file:///old', 0, 2, 8, 60.0,"
            " '2025-01-01 00:00:00', '2025-01-01 00:00:00')"
        )
        conn.exec_driver_sql(
            "INSERT INTO usage_events (request_id, tenant_id, deployment, endpoint, status,"
            " prompt_tokens, cached_tokens, completion_tokens, cold_start, created_at)"
            " VALUES ('req-old', 1, 'old', 'completions', 'completed', 1, 0, 2, false,"
            " '2025-01-01 00:00:00')"
        )

    empty_db.upgrade()
    assert empty_db.current_revision() == HEAD
    assert _columns(empty_db, "deployments") >= DEPLOYMENT_OPTIONS
    assert "client_request_id" in _columns(empty_db, "usage_events")
    checks = {ck["name"] for ck in inspect(empty_db.engine).get_check_constraints("deployments")}
    assert checks >= DEPLOYMENT_CHECKS
    old = DeploymentStore(empty_db).get("old")
    assert old is not None
    assert (old.max_replicas, old.generation, old.dtype, old.max_queue) == (2, 1, None, None)
    [event] = Ledger(empty_db).events()
    assert (event.request_id, event.client_request_id) == ("req-old", None)

    empty_db.downgrade("0003")
    assert empty_db.current_revision() == "0003"
    assert _columns(empty_db, "deployments") & DEPLOYMENT_OPTIONS == set()
    assert "client_request_id" not in _columns(empty_db, "usage_events")
    checks = {ck["name"] for ck in inspect(empty_db.engine).get_check_constraints("deployments")}
    assert checks & DEPLOYMENT_CHECKS == set()
    with empty_db.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT name, max_replicas FROM deployments").all() == [
            ("old", 2)
        ]
        assert conn.exec_driver_sql("SELECT request_id FROM usage_events").scalars().all() == [
            "req-old"
        ]

    empty_db.upgrade()
    assert DeploymentStore(empty_db).get("old").generation == 1  # type: ignore[union-attr]


COST_COLUMNS = {"cost_micros", "currency", "corrects_id", "reason"}


def test_migration_0005_up_and_down_keeps_usage(empty_db: Database) -> None:
    empty_db.upgrade("0004")
    with empty_db.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO usage_events (request_id, tenant_id, deployment, endpoint, status,"
            " prompt_tokens, cached_tokens, completion_tokens, cold_start, created_at,"
            " api_key_id, client_request_id) VALUES ('req-old', 1, 'old', 'completions',"
            " 'completed', 5, 2, 3, true, '2025-01-01 00:00:00', 4, 'c-1')"
        )

    empty_db.upgrade()
    assert "prices" in _tables(empty_db)
    assert _columns(empty_db, "usage_events") >= COST_COLUMNS
    checks = {ck["name"] for ck in inspect(empty_db.engine).get_check_constraints("usage_events")}
    assert {"ck_usage_events_cost_nonnegative", "ck_usage_events_cost_has_currency"} <= checks
    # The rebuilt table (SQLite) kept every row, value and id; events recorded before have
    # no cost: none was computed then.
    [event] = Ledger(empty_db).events()
    assert (event.id, event.request_id, event.prompt_tokens, event.cached_tokens) == (
        1, "req-old", 5, 2
    )  # fmt: skip
    assert (event.api_key_id, event.client_request_id, event.cold_start) == (4, "c-1", True)
    assert (event.cost_micros, event.currency, event.corrects_id) == (None, None, None)
    # The next id continues after the kept one.
    Ledger(empty_db).record(UsageRecord("req-new", "old", "completions", "completed", 1, 1))
    assert sorted(e.id for e in Ledger(empty_db).events()) == [1, 2]

    empty_db.downgrade("0004")
    assert "prices" not in _tables(empty_db)
    assert _columns(empty_db, "usage_events") & COST_COLUMNS == set()
    checks = {ck["name"] for ck in inspect(empty_db.engine).get_check_constraints("usage_events")}
    assert "ck_usage_events_cached_le_prompt" in checks
    assert "ck_usage_events_cost_nonnegative" not in checks
    with empty_db.engine.connect() as conn:
        assert conn.exec_driver_sql(
            "SELECT request_id, prompt_tokens FROM usage_events ORDER BY id"
        ).all() == [("req-old", 5), ("req-new", 1)]
    # 0004's checks hold again: a negative count is refused.
    with pytest.raises(IntegrityError), empty_db.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE usage_events SET prompt_tokens = -1 WHERE request_id = 'req-old'"
        )
    empty_db.upgrade()
    assert empty_db.current_revision() == HEAD


def test_migration_0006_up_and_down_leaves_events_alone(db: Database) -> None:
    Ledger(db).record(UsageRecord("req-1", "m", "completions", "completed", 5, 5))
    pk = inspect(db.engine).get_pk_constraint("usage_rollups_hourly")
    assert pk["constrained_columns"] == ["hour", "tenant_id", "deployment"]
    db.downgrade("0005")
    assert "usage_rollups_hourly" not in _tables(db)
    with db.engine.connect() as conn:  # raw SQL: today's model has columns 0005 lacks
        assert conn.exec_driver_sql("SELECT request_id FROM usage_events").all() == [("req-1",)]
    db.upgrade()
    assert db.current_revision() == HEAD
    assert "usage_rollups_hourly" in _tables(db)


def test_migration_0007_gives_old_scale_events_their_deployments_tenant(
    empty_db: Database,
) -> None:
    empty_db.upgrade("0006")
    with empty_db.engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO tenants (id, name, created_at) VALUES (7, 'acme', "
                             "'2025-01-01 00:00:00')")  # fmt: skip
        conn.exec_driver_sql(
            "INSERT INTO deployments (name, tenant_id, snapshot_uri, min_replicas, max_replicas,"
            " target_concurrency, idle_timeout_s, created_at, updated_at) VALUES ('live', 7,"
            " 'file:///s', 0, 1, 8, 300, '2025-01-01 00:00:00', '2025-01-01 00:00:00')"
        )
        for name in ("live", "gone"):
            conn.exec_driver_sql(
                "INSERT INTO scale_events (deployment, from_replicas, to_replicas, reason,"
                f" created_at) VALUES ('{name}', 0, 1, 'up', '2025-01-01 00:00:00')"
            )
    empty_db.upgrade()
    events = {e.deployment: e for e in ScaleEventStore(empty_db).list()}
    assert (events["live"].tenant_id, events["gone"].tenant_id) == (7, None)
    assert events["live"].phases is None
    empty_db.downgrade("0006")
    assert {"tenant_id", "phases"} & _columns(empty_db, "scale_events") == set()
    assert ScaleEventStore(empty_db).count() == 2
    empty_db.upgrade()
    assert empty_db.current_revision() == HEAD


def test_migration_0008_makes_each_deployment_its_stable_version(empty_db: Database) -> None:
    empty_db.upgrade("0007")
    with empty_db.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO deployments (name, tenant_id, snapshot_uri, min_replicas, max_replicas,"
            " target_concurrency, idle_timeout_s, created_at, updated_at, generation, dtype)"
            " VALUES ('chat', 1, 'file:///s3', 0, 1, 8, 300, '2025-01-01 00:00:00',"
            " '2025-01-02 00:00:00', 3, 'fp32')"
        )
    empty_db.upgrade()
    [v] = DeploymentStore(empty_db).versions("chat")
    assert (v.version, v.snapshot_uri, v.dtype, v.changes) == (3, "file:///s3", "fp32", None)
    spec = DeploymentStore(empty_db).update("chat", snapshot_uri="file:///s4")
    assert (spec.generation, spec.previous_version) == (4, 3)
    empty_db.downgrade("0007")
    assert "deployment_versions" not in _tables(empty_db)
    empty_db.upgrade()
    assert empty_db.current_revision() == HEAD


# A deployment row as revisions 0008-0010 hold it (no column added since).
CHAT_AT_GENERATION_1 = (
    "INSERT INTO deployments (name, tenant_id, snapshot_uri, min_replicas, max_replicas,"
    " target_concurrency, idle_timeout_s, created_at, updated_at, generation)"
    " VALUES ('chat', 1, 'file:///s', 0, 1, 8, 300, '2025-01-01 00:00:00',"
    " '2025-01-02 00:00:00', 1)"
)


def test_migration_0011_leaves_answers_unbounded_and_checks_the_bounds(
    empty_db: Database,
) -> None:
    empty_db.upgrade("0010")
    with empty_db.engine.begin() as conn:
        conn.exec_driver_sql(CHAT_AT_GENERATION_1)
    empty_db.upgrade()
    store = DeploymentStore(empty_db)
    chat = store.get("chat")
    assert chat is not None and (chat.default_max_tokens, chat.max_tokens_limit) == (None, None)
    spec = store.update("chat", default_max_tokens=256, max_tokens_limit=1024)
    assert spec.generation == 1  # not a new version: the control plane applies them
    with pytest.raises(IntegrityError), empty_db.engine.begin() as conn:  # the database's own check
        conn.exec_driver_sql("UPDATE deployments SET max_tokens_limit = 0")

    empty_db.downgrade("0010")
    assert "default_max_tokens" not in _columns(empty_db, "deployments")
    empty_db.upgrade()
    assert empty_db.current_revision() == HEAD


def test_migration_0010_gives_deployments_and_versions_no_speculation(
    empty_db: Database,
) -> None:
    empty_db.upgrade("0009")
    with empty_db.engine.begin() as conn:
        conn.exec_driver_sql(CHAT_AT_GENERATION_1)
        conn.exec_driver_sql(
            "INSERT INTO deployment_versions (deployment_id, version, snapshot_uri, created_at)"
            " SELECT id, 1, snapshot_uri, updated_at FROM deployments"
        )
    empty_db.upgrade()
    store = DeploymentStore(empty_db)
    chat = store.get("chat")
    assert chat is not None and chat.speculative is None
    policy = '{"max_batch":4,"method":"ngram","num_tokens":3}'
    spec = store.update("chat", speculative=policy)  # a new version: replicas run differently
    assert spec.generation == 2 and store.version("chat", 2).speculative == policy
    assert store.version("chat", 1).speculative is None

    empty_db.downgrade("0009")
    assert "speculative" not in _columns(empty_db, "deployments")
    assert "speculative" not in _columns(empty_db, "deployment_versions")
    empty_db.upgrade()
    assert empty_db.current_revision() == HEAD


def test_migration_0009_gives_deployments_and_versions_no_quantization(
    empty_db: Database,
) -> None:
    empty_db.upgrade("0008")
    with empty_db.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO deployments (name, tenant_id, snapshot_uri, min_replicas, max_replicas,"
            " target_concurrency, idle_timeout_s, created_at, updated_at, generation, dtype)"
            " VALUES ('chat', 1, 'file:///s', 0, 1, 8, 300, '2025-01-01 00:00:00',"
            " '2025-01-02 00:00:00', 1, 'fp16')"
        )
        conn.exec_driver_sql(
            "INSERT INTO deployment_versions (deployment_id, version, snapshot_uri, dtype,"
            " created_at) SELECT id, 1, snapshot_uri, dtype, updated_at FROM deployments"
        )
    empty_db.upgrade()
    store = DeploymentStore(empty_db)
    chat = store.get("chat")
    assert chat is not None and (chat.quantization, chat.dtype) == ("none", "fp16")
    [v1] = store.versions("chat")
    assert v1.quantization == "none"
    assert "ck_deployments_quantization_valid" in {
        ck["name"] for ck in inspect(empty_db.engine).get_check_constraints("deployments")
    }
    store.update("chat", quantization="gguf")
    assert store.version("chat", 2).quantization == "gguf"

    empty_db.downgrade("0008")
    assert "quantization" not in _columns(empty_db, "deployments")
    assert "quantization" not in _columns(empty_db, "deployment_versions")
    with empty_db.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT version, dtype FROM deployment_versions").all() == [
            (1, "fp16"),
            (2, "fp16"),
        ]
    empty_db.upgrade()
    assert empty_db.current_revision() == HEAD


def test_downgrade_below_0005_refuses_to_drop_corrections(db: Database) -> None:
    ledger = Ledger(db)
    ledger.record(UsageRecord("req-1", "m", "completions", "completed", 5, 5))
    ledger.correct("req-1", prompt_tokens=4, completion_tokens=5, reason="recount")
    with pytest.raises(RuntimeError, match="usage_events holds 1 correction rows"):
        db.downgrade("0004")
    assert db.current_revision() == HEAD
    assert len(ledger.events()) == 2


@pytest.mark.parametrize(
    ("column", "value", "check"),
    [
        ("max_queue", 0, "max_queue_positive"),
        ("queue_timeout_s", 0.0, "queue_timeout_positive"),
        ("dtype", "int8", "dtype_valid"),
        ("quantization", "int4", "quantization_valid"),
        ("max_model_len", 15, "max_model_len_min"),
        ("kv_cache_bytes", 1048575, "kv_cache_bytes_min"),
        ("generation", 0, "generation_positive"),
    ],
)
def test_deployment_checks_hold_in_the_database(
    db: Database, column: str, value: object, check: str
) -> None:
    # What DeploymentSpec validates must also hold for a row written some other way.
    DeploymentStore(db).create(DeploymentSpec("m", "file:///m"))
    update = text(f"UPDATE deployments SET {column} = :value WHERE name = 'm'")
    with pytest.raises(IntegrityError, match=f"ck_deployments_{check}"), db.engine.begin() as conn:
        conn.execute(update, {"value": value})
    with db.engine.begin() as conn:  # NULL stays allowed where the column is nullable
        for nullable in sorted(DEPLOYMENT_OPTIONS - {"generation"}):
            conn.execute(text(f"UPDATE deployments SET {nullable} = NULL WHERE name = 'm'"))


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
    assert "CREATE TABLE prices" in sql
    assert "CREATE TABLE usage_rollups_hourly" in sql
    assert "INSERT INTO tenants" in sql
    assert empty_db.current_revision() is None  # nothing ran


def test_migrations_ship_inside_the_package() -> None:
    folder = migrations_dir()
    assert (folder / "env.py").is_file()
    assert (folder / "script.py.mako").is_file()
    assert (folder / "versions" / "0001_initial.py").is_file()
    assert (folder / "versions" / "0002_scale_events.py").is_file()
    assert (folder / "versions" / "0003_api_keys.py").is_file()
    assert (folder / "versions" / "0004_deployment_options.py").is_file()
    assert (folder / "versions" / "0005_prices.py").is_file()
    assert (folder / "versions" / "0006_usage_rollups.py").is_file()
    assert (folder / "versions" / "0007_scale_event_details.py").is_file()
    assert (folder / "versions" / "0008_deployment_versions.py").is_file()
    assert (folder / "versions" / "0010_deployment_speculative.py").is_file()
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


def test_a_new_sqlite_ledger_and_its_wal_are_readable_by_their_owner_only(
    tmp_path: Path,
) -> None:
    """It holds every tenant's usage and the API keys' hashes: hotpool.db was made 0644."""
    path = tmp_path / "home" / "hotpool.db"
    db = Database(f"sqlite:///{path}")
    try:
        db.upgrade()
        with db.engine.connect() as conn:  # a write, so the write-ahead log exists
            conn.execute(text("CREATE TABLE probe (x INTEGER)"))
            conn.commit()
            files = [p for p in path.parent.iterdir() if p.name.startswith("hotpool.db")]
            assert {p.name for p in files} >= {"hotpool.db", "hotpool.db-wal"}
            assert {p.name: p.stat().st_mode & 0o777 for p in files} == {
                p.name: 0o600 for p in files
            }
    finally:
        db.dispose()


def test_a_new_sqlite_ledger_says_so_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`hotpool serve` on a new home made the ledger with a line per migration (16 of them
    before the banner); one line says what happened instead, and nothing when nothing did."""
    db = Database(f"sqlite:///{tmp_path / 'ledger.db'}")
    with caplog.at_level(logging.INFO):
        db.ensure_schema()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"ledger database created at revision {HEAD} ({db})"]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        db.ensure_schema()
    assert caplog.records == []
    db.dispose()
