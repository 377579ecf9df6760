"""Scale events keep the tenant that owned the deployment and the cold start's phases.

The tenant lets the dashboard show a tenant its own scaling history, including that of
deployments it has since deleted (the name may be taken again by another tenant later).
Existing rows take the tenant of the deployment now holding their name, if any.

Revision ID: 0007
Revises: 0006
Create Date: 2025-05-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # No foreign key, like usage_events.deployment: the history outlives what it names.
    op.add_column("scale_events", sa.Column("tenant_id", sa.Integer(), nullable=True))
    # JSON text {"phase": seconds}: the phases of the scale-up's cold start.
    op.add_column("scale_events", sa.Column("phases", sa.Text(), nullable=True))
    op.create_index(
        op.f("ix_scale_events_tenant_id_created_at"), "scale_events", ["tenant_id", "created_at"]
    )
    op.execute(
        "UPDATE scale_events SET tenant_id = (SELECT deployments.tenant_id FROM deployments"
        " WHERE deployments.name = scale_events.deployment)"
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_scale_events_tenant_id_created_at"), table_name="scale_events")
    op.drop_column("scale_events", "phases")
    op.drop_column("scale_events", "tenant_id")
