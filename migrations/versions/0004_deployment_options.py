"""Deployment options (queue, dtype, context length, KV cache), a generation counter, and
the client's own request id on usage events.

Revision ID: 0004
Revises: 0003
Create Date: 2025-03-15
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (column, type, check, constraint name) of each new deployments column, all nullable:
# NULL means "the default" (the server's or the snapshot's).
_OPTIONS: tuple[tuple[str, sa.types.TypeEngine[Any], str, str], ...] = (
    ("max_queue", sa.Integer(), "max_queue >= 1", "max_queue_positive"),
    ("queue_timeout_s", sa.Float(), "queue_timeout_s > 0", "queue_timeout_positive"),
    ("dtype", sa.String(length=8), "dtype IN ('bf16', 'fp16', 'fp32')", "dtype_valid"),
    ("max_model_len", sa.Integer(), "max_model_len >= 16", "max_model_len_min"),
    ("kv_cache_bytes", sa.BigInteger(), "kv_cache_bytes >= 1048576", "kv_cache_bytes_min"),
)


def _checked(
    name: str,
    type_: sa.types.TypeEngine[Any],
    check: str,
    ck_name: str,
    *,
    nullable: bool = True,
    server_default: str | None = None,
) -> sa.Column[Any]:
    # The CHECK goes on the column itself: SQLite cannot ALTER TABLE ADD CONSTRAINT, but it
    # takes a column constraint in ADD COLUMN, and DROP COLUMN drops it with the column.
    constraint = sa.CheckConstraint(check, name=op.f(f"ck_deployments_{ck_name}"))
    return sa.Column(name, type_, constraint, nullable=nullable, server_default=server_default)


def upgrade() -> None:
    for name, type_, check, ck_name in _OPTIONS:
        op.add_column("deployments", _checked(name, type_, check, ck_name))
    # Existing deployments start at generation 1.
    op.add_column(
        "deployments",
        _checked(
            "generation",
            sa.Integer(),
            "generation >= 1",
            "generation_positive",
            nullable=False,
            server_default="1",
        ),
    )
    op.add_column("usage_events", sa.Column("client_request_id", sa.String(64), nullable=True))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite >= 3.35 has it): batch mode would rebuild both tables.
    op.drop_column("usage_events", "client_request_id")
    op.drop_column("deployments", "generation")
    for name, *_ in reversed(_OPTIONS):
        op.drop_column("deployments", name)
