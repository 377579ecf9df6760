"""Prices, the cost of each usage event at ingest, and corrections of usage events.

Usage events get ``cost_micros`` and ``currency`` (NULL: no price in force), and
``corrects_id`` and ``reason`` for correction rows, whose counts are deltas: the checks that
keep counts non-negative now exempt those rows. SQLite cannot change a CHECK in place, so
there ``usage_events`` is rebuilt (batch mode, from the frozen 0004 shape below, which also
lets offline mode render it); PostgreSQL alters it.

Revision ID: 0005
Revises: 0004
Create Date: 2025-04-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the model types: a migration must not change when the models do.
BIG_INT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# (constraint name, check) of the token counts, which 0005 waives for correction rows
_TOKEN_CHECKS = (
    ("prompt_tokens_nonnegative", "prompt_tokens >= 0"),
    ("cached_tokens_nonnegative", "cached_tokens >= 0"),
    ("completion_tokens_nonnegative", "completion_tokens >= 0"),
    ("cached_le_prompt", "cached_tokens <= prompt_tokens"),
)


def _timestamp() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def _checked(check: str, corrections: bool) -> str:
    """A token check as it reads before 0005, or with correction rows exempt from it."""
    return f"corrects_id IS NOT NULL OR {check}" if corrections else check


def _usage_events(corrections: bool) -> sa.Table:
    """``usage_events`` as revision 0004 (``corrections=False``) or 0005 leaves it: the shape
    batch mode copies when it rebuilds the table on SQLite."""
    extra: list[sa.SchemaItem] = []
    if corrections:
        extra = [
            sa.Column("cost_micros", sa.BigInteger(), nullable=True),
            sa.Column("currency", sa.String(length=3), nullable=True),
            sa.Column("corrects_id", sa.BigInteger(), nullable=True),
            sa.Column("reason", sa.Text(), nullable=True),
            sa.CheckConstraint(
                "corrects_id IS NOT NULL OR cost_micros >= 0",
                name="ck_usage_events_cost_nonnegative",
            ),
            sa.CheckConstraint(
                "(cost_micros IS NULL) = (currency IS NULL)",
                name="ck_usage_events_cost_has_currency",
            ),
            sa.Index("ix_usage_events_corrects_id", "corrects_id"),
        ]
    return sa.Table(
        "usage_events",
        sa.MetaData(),
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
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("client_request_id", sa.String(length=64), nullable=True),
        sa.CheckConstraint(
            "status IN ('completed', 'partial', 'error', 'cancelled')",
            name="ck_usage_events_status_valid",
        ),
        *(
            sa.CheckConstraint(_checked(check, corrections), name=f"ck_usage_events_{name}")
            for name, check in _TOKEN_CHECKS
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_usage_events_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_usage_events"),
        sa.UniqueConstraint("request_id", name="uq_usage_events_request_id"),
        sa.Index("ix_usage_events_created_at", "created_at"),
        sa.Index("ix_usage_events_deployment_created_at", "deployment", "created_at"),
        sa.Index("ix_usage_events_tenant_id", "tenant_id"),
        *extra,
    )


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment", sa.String(length=128), nullable=True),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("input", sa.BigInteger(), nullable=False),
        sa.Column("cached_input", sa.BigInteger(), nullable=False),
        sa.Column("output", sa.BigInteger(), nullable=False),
        sa.Column("effective_from", _timestamp(), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.CheckConstraint("input >= 0", name=op.f("ck_prices_input_nonnegative")),
        sa.CheckConstraint("cached_input >= 0", name=op.f("ck_prices_cached_input_nonnegative")),
        sa.CheckConstraint("output >= 0", name=op.f("ck_prices_output_nonnegative")),
        sa.CheckConstraint(
            "length(currency) = 3 AND upper(currency) = currency",
            name=op.f("ck_prices_currency_iso"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
        sa.UniqueConstraint(
            "deployment", "effective_from", name=op.f("uq_prices_deployment_effective_from")
        ),
    )
    op.create_index(
        op.f("uq_prices_default_effective_from"),
        "prices",
        ["effective_from"],
        unique=True,
        sqlite_where=sa.text("deployment IS NULL"),
        postgresql_where=sa.text("deployment IS NULL"),
    )
    with op.batch_alter_table("usage_events", copy_from=_usage_events(corrections=False)) as batch:
        batch.add_column(sa.Column("cost_micros", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("currency", sa.String(length=3), nullable=True))
        batch.add_column(sa.Column("corrects_id", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("reason", sa.Text(), nullable=True))
        for name, check in _TOKEN_CHECKS:
            batch.drop_constraint(op.f(f"ck_usage_events_{name}"), type_="check")
            batch.create_check_constraint(
                op.f(f"ck_usage_events_{name}"), _checked(check, corrections=True)
            )
        batch.create_check_constraint(
            op.f("ck_usage_events_cost_nonnegative"), "corrects_id IS NOT NULL OR cost_micros >= 0"
        )
        batch.create_check_constraint(
            op.f("ck_usage_events_cost_has_currency"), "(cost_micros IS NULL) = (currency IS NULL)"
        )
        batch.create_index(op.f("ix_usage_events_corrects_id"), ["corrects_id"])


def downgrade() -> None:
    if not context.is_offline_mode():
        # Correction rows cannot be kept: their negative deltas break the old checks, and
        # as ordinary rows they would count as requests. Refuse rather than lose them.
        corrections = op.get_bind().execute(
            sa.text("SELECT count(*) FROM usage_events WHERE corrects_id IS NOT NULL")
        )
        if n := corrections.scalar_one():
            raise RuntimeError(
                f"cannot downgrade below 0005: usage_events holds {n} correction rows,"
                " which revision 0004 cannot represent"
            )
    with op.batch_alter_table("usage_events", copy_from=_usage_events(corrections=True)) as batch:
        batch.drop_index(op.f("ix_usage_events_corrects_id"))
        batch.drop_constraint(op.f("ck_usage_events_cost_has_currency"), type_="check")
        batch.drop_constraint(op.f("ck_usage_events_cost_nonnegative"), type_="check")
        for name, check in _TOKEN_CHECKS:
            batch.drop_constraint(op.f(f"ck_usage_events_{name}"), type_="check")
            batch.create_check_constraint(op.f(f"ck_usage_events_{name}"), check)
        for column in ("reason", "corrects_id", "currency", "cost_micros"):
            batch.drop_column(column)
    op.drop_index(op.f("uq_prices_default_effective_from"), table_name="prices")
    op.drop_table("prices")
