"""Scale events: the autoscaler's replica-count changes and their cold-start times.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the model types: a migration must not change when the models do.
BIG_INT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _timestamp() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "scale_events",
        sa.Column("id", BIG_INT_PK, nullable=False),
        sa.Column("deployment", sa.String(length=128), nullable=False),
        sa.Column("from_replicas", sa.Integer(), nullable=False),
        sa.Column("to_replicas", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(length=256), nullable=False),
        sa.Column("cold_start_seconds", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.CheckConstraint(
            "from_replicas >= 0", name=op.f("ck_scale_events_from_replicas_nonnegative")
        ),
        sa.CheckConstraint(
            "to_replicas >= 0", name=op.f("ck_scale_events_to_replicas_nonnegative")
        ),
        sa.CheckConstraint(
            "from_replicas <> to_replicas", name=op.f("ck_scale_events_replicas_changed")
        ),
        sa.CheckConstraint(
            "cold_start_seconds >= 0", name=op.f("ck_scale_events_cold_start_seconds_nonnegative")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scale_events")),
    )
    op.create_index(
        op.f("ix_scale_events_deployment_created_at"),
        "scale_events",
        ["deployment", "created_at"],
    )


def downgrade() -> None:
    op.drop_table("scale_events")
