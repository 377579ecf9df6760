"""Hourly usage rollups: sums of usage events per UTC hour, tenant and deployment.

Derived data, rebuilt from ``usage_events`` by ``hotpool ledger rollup``; the table starts
empty, and downgrading drops it without loss.

Revision ID: 0006
Revises: 0005
Create Date: 2025-04-15
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "usage_rollups_hourly",
        sa.Column("hour", _timestamp(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("deployment", sa.String(length=128), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_micros", sa.BigInteger(), nullable=True),
        sa.Column("currency", sa.String(length=3), nullable=True),
        sa.Column("rebuilt_at", _timestamp(), nullable=False),
        sa.CheckConstraint(
            "requests >= 0", name=op.f("ck_usage_rollups_hourly_requests_nonnegative")
        ),
        sa.CheckConstraint(
            "(cost_micros IS NULL) = (currency IS NULL)",
            name=op.f("ck_usage_rollups_hourly_cost_has_currency"),
        ),
        sa.PrimaryKeyConstraint(
            "hour", "tenant_id", "deployment", name=op.f("pk_usage_rollups_hourly")
        ),
    )


def downgrade() -> None:
    op.drop_table("usage_rollups_hourly")
