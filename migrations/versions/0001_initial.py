"""Initial ledger: tenants, deployments, usage events and the default tenant.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the model types: a migration must not change when the models do.
BIG_INT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _timestamp() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    tenants = op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "deployments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("snapshot_uri", sa.Text(), nullable=False),
        sa.Column("min_replicas", sa.Integer(), nullable=False),
        sa.Column("max_replicas", sa.Integer(), nullable=False),
        sa.Column("target_concurrency", sa.Integer(), nullable=False),
        sa.Column("idle_timeout_s", sa.Float(), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.Column("updated_at", _timestamp(), nullable=False),
        sa.CheckConstraint(
            "min_replicas >= 0", name=op.f("ck_deployments_min_replicas_nonnegative")
        ),
        sa.CheckConstraint("max_replicas >= 1", name=op.f("ck_deployments_max_replicas_positive")),
        sa.CheckConstraint(
            "max_replicas >= min_replicas", name=op.f("ck_deployments_max_replicas_ge_min")
        ),
        sa.CheckConstraint(
            "target_concurrency >= 1", name=op.f("ck_deployments_target_concurrency_positive")
        ),
        sa.CheckConstraint(
            "idle_timeout_s >= 0", name=op.f("ck_deployments_idle_timeout_nonnegative")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_deployments_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployments")),
        sa.UniqueConstraint("name", name=op.f("uq_deployments_name")),
    )
    op.create_index(op.f("ix_deployments_tenant_id"), "deployments", ["tenant_id"])
    op.create_table(
        "usage_events",
        sa.Column("id", BIG_INT_PK, nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("deployment", sa.String(length=128), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("queue_seconds", sa.Float(), nullable=True),
        sa.Column("ttft_seconds", sa.Float(), nullable=True),
        sa.Column("total_seconds", sa.Float(), nullable=True),
        sa.Column("cold_start", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.CheckConstraint(
            "status IN ('completed', 'partial', 'error', 'cancelled')",
            name=op.f("ck_usage_events_status_valid"),
        ),
        sa.CheckConstraint(
            "prompt_tokens >= 0", name=op.f("ck_usage_events_prompt_tokens_nonnegative")
        ),
        sa.CheckConstraint(
            "cached_tokens >= 0", name=op.f("ck_usage_events_cached_tokens_nonnegative")
        ),
        sa.CheckConstraint(
            "completion_tokens >= 0", name=op.f("ck_usage_events_completion_tokens_nonnegative")
        ),
        sa.CheckConstraint(
            "cached_tokens <= prompt_tokens", name=op.f("ck_usage_events_cached_le_prompt")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_events_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_events")),
        sa.UniqueConstraint("request_id", name=op.f("uq_usage_events_request_id")),
    )
    op.create_index(op.f("ix_usage_events_created_at"), "usage_events", ["created_at"])
    op.create_index(
        op.f("ix_usage_events_deployment_created_at"),
        "usage_events",
        ["deployment", "created_at"],
    )
    op.create_index(op.f("ix_usage_events_tenant_id"), "usage_events", ["tenant_id"])

    op.bulk_insert(tenants, [{"id": 1, "name": "default", "created_at": datetime.now(UTC)}])
    if op.get_bind().dialect.name == "postgresql":
        # An explicit id does not advance the serial; the next tenant would collide with 1.
        op.execute(
            "SELECT setval(pg_get_serial_sequence('tenants', 'id'), (SELECT max(id) FROM tenants))"
        )


def downgrade() -> None:
    op.drop_table("usage_events")
    op.drop_table("deployments")
    op.drop_table("tenants")
