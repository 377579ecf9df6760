"""A deployment's speculative decoding policy (JSON text), on the deployment and on each
version.

Existing deployments and versions get NULL: no speculation, as they were served before.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: ADD COLUMN on SQLite and PostgreSQL alike, no table rebuild.
    op.add_column("deployments", sa.Column("speculative", sa.Text(), nullable=True))
    op.add_column("deployment_versions", sa.Column("speculative", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("deployment_versions", "speculative")
    op.drop_column("deployments", "speculative")
