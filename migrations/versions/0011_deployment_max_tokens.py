"""A deployment's bounds on an answer's length: ``default_max_tokens`` (what a request
without ``max_tokens`` gets) and ``max_tokens_limit`` (the most one may ask for).

Existing deployments get NULL for both: answers unbounded but by the context, as before.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = {"default_max_tokens": "default_max_tokens_positive",
           "max_tokens_limit": "max_tokens_limit_positive"}  # fmt: skip


def upgrade() -> None:
    # Column constraints, as in 0009: SQLite takes them in ADD COLUMN (NULL passes a CHECK).
    for column, check in COLUMNS.items():
        positive = sa.CheckConstraint(f"{column} >= 1", name=op.f(f"ck_deployments_{check}"))
        op.add_column("deployments", sa.Column(column, sa.Integer(), positive, nullable=True))


def downgrade() -> None:
    for column in reversed(COLUMNS):
        op.drop_column("deployments", column)
