"""Deployment versions, a canary split, and the version each request was served by.

Every deployment gets its current settings as version ``generation`` (the stable one); the
version rows keep what replicas of each version run.

Revision ID: 0008
Revises: 0007
Create Date: 2025-06-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "deployment_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("snapshot_uri", sa.Text(), nullable=False),
        sa.Column("dtype", sa.String(length=8), nullable=True),
        sa.Column("max_model_len", sa.Integer(), nullable=True),
        sa.Column("kv_cache_bytes", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=64), nullable=True),
        sa.Column("changes", sa.Text(), nullable=True),
        sa.CheckConstraint("version >= 1", name=op.f("ck_deployment_versions_version_positive")),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_deployment_versions_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployment_versions")),
        sa.UniqueConstraint(
            "deployment_id", "version", name=op.f("uq_deployment_versions_deployment_id_version")
        ),
    )
    # Column constraints, as in 0004: SQLite takes them in ADD COLUMN.
    percent = sa.CheckConstraint(
        "canary_percent >= 0 AND canary_percent <= 100",
        name=op.f("ck_deployments_canary_percent_range"),
    )
    op.add_column("deployments", sa.Column("canary_version", sa.Integer(), nullable=True))
    op.add_column("deployments", sa.Column("canary_percent", sa.Float(), percent, nullable=True))
    op.add_column("deployments", sa.Column("previous_version", sa.Integer(), nullable=True))
    op.add_column("usage_events", sa.Column("version", sa.Integer(), nullable=True))
    op.execute(
        "INSERT INTO deployment_versions (deployment_id, version, snapshot_uri, dtype,"
        " max_model_len, kv_cache_bytes, created_at)"
        " SELECT id, generation, snapshot_uri, dtype, max_model_len, kv_cache_bytes, updated_at"
        " FROM deployments"
    )


def downgrade() -> None:
    op.drop_column("usage_events", "version")
    op.drop_column("deployments", "previous_version")
    op.drop_column("deployments", "canary_percent")
    op.drop_column("deployments", "canary_version")
    op.drop_table("deployment_versions")
