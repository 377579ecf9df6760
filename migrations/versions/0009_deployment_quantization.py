"""A deployment's quantization (none, int8, gguf), on the deployment and on each version.

Existing deployments and versions get ``none``: weights in the activation dtype, as they
were served before.

Revision ID: 0009
Revises: 0008
Create Date: 2025-07-01
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _quantization(*constraints: sa.CheckConstraint) -> sa.Column[Any]:
    return sa.Column(
        "quantization", sa.String(length=8), *constraints, nullable=False, server_default="none"
    )


def upgrade() -> None:
    # A column constraint, as in 0004: SQLite takes it in ADD COLUMN (and checks the existing
    # rows, which the default satisfies), where batch mode would rebuild the table.
    valid = sa.CheckConstraint(
        "quantization IN ('none', 'int8', 'gguf')", name=op.f("ck_deployments_quantization_valid")
    )
    op.add_column("deployments", _quantization(valid))
    op.add_column("deployment_versions", _quantization())


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite >= 3.35): the CHECK goes with its column.
    op.drop_column("deployment_versions", "quantization")
    op.drop_column("deployments", "quantization")
