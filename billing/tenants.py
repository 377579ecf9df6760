"""Tenants: who owns deployments, API keys and usage.

Every database starts with the ``default`` tenant (id 1, created by the first migration);
with auth off, every caller is that tenant. Tenants are never deleted: usage refers to them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from hotpool.billing.db import Database
from hotpool.billing.models import Tenant

TENANT_NAME_MAX_LEN = 64
# A name goes into URLs, metric labels and shell commands, so it needs no quoting anywhere.
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


class TenantExists(Exception):
    """A tenant with this name already exists."""

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant {name!r} already exists")
        self.name = name


@dataclass(frozen=True)
class TenantRecord:
    id: int
    name: str
    created_at: datetime


def check_tenant_name(name: str) -> str:
    """``name`` if it is a valid tenant name, else ValueError saying what a name may be."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(
            f"invalid tenant name {name!r}: use 1 to {TENANT_NAME_MAX_LEN} characters of"
            " a-z, 0-9, '.', '_' and '-', starting with a letter or digit"
        )
    return name


class TenantStore:
    """Create and read tenants in the database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, name: str) -> TenantRecord:
        """Store a new tenant; ValueError for an invalid name, TenantExists if it is taken."""
        row = Tenant(name=check_tenant_name(name))
        try:
            with self.db.session() as session, session.begin():
                session.add(row)
        except IntegrityError as exc:
            # The unique name decides, so two concurrent creates cannot both succeed.
            if self.by_name(name) is not None:
                raise TenantExists(name) from exc
            raise
        return _record(row)

    def get(self, tenant_id: int) -> TenantRecord | None:
        with self.db.session() as session:
            row = session.get(Tenant, tenant_id)
            return None if row is None else _record(row)

    def by_name(self, name: str) -> TenantRecord | None:
        """The tenant called ``name``; None if there is none, or if no tenant could be."""
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            return None  # also keeps strings PostgreSQL refuses (NUL) away from it
        with self.db.session() as session:
            row = session.scalar(select(Tenant).where(Tenant.name == name))
            return None if row is None else _record(row)

    def list(self) -> list[TenantRecord]:
        """Every tenant, oldest (the default tenant) first."""
        with self.db.session() as session:
            return [_record(row) for row in session.scalars(select(Tenant).order_by(Tenant.id))]


def _record(row: Tenant) -> TenantRecord:
    return TenantRecord(id=row.id, name=row.name, created_at=row.created_at)
