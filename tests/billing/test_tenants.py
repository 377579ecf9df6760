from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest

from hotpool.billing.db import Database
from hotpool.billing.models import DEFAULT_TENANT_ID
from hotpool.billing.tenants import TenantExists, TenantRecord, TenantStore


def test_the_default_tenant_is_there_from_the_start(db: Database) -> None:
    store = TenantStore(db)
    default = store.get(DEFAULT_TENANT_ID)
    assert default is not None
    assert (default.id, default.name) == (1, "default")
    assert store.by_name("default") == default
    assert store.list() == [default]


def test_create_then_read_back(db: Database) -> None:
    store = TenantStore(db)
    before = datetime.now(UTC)
    acme = store.create("acme")
    after = datetime.now(UTC)
    assert isinstance(acme, TenantRecord)
    assert acme.id == 2 and acme.name == "acme"
    assert acme.created_at.tzinfo is UTC and before <= acme.created_at <= after
    assert store.get(acme.id) == acme
    assert store.by_name("acme") == acme


def test_list_is_oldest_first(db: Database) -> None:
    store = TenantStore(db)
    for name in ("zeta", "alpha", "mid-1"):
        store.create(name)
    assert [t.name for t in store.list()] == ["default", "zeta", "alpha", "mid-1"]


def test_unknown_tenant_is_none(db: Database) -> None:
    store = TenantStore(db)
    assert store.get(999) is None
    assert store.by_name("nobody") is None
    # Names no tenant can have never reach the database (PostgreSQL refuses NUL outright).
    for name in ("", "a\x00b", "Default", "x" * 10_000, "ünï"):
        assert store.by_name(name) is None


def test_a_taken_name_raises_tenant_exists(db: Database) -> None:
    store = TenantStore(db)
    store.create("acme")
    with pytest.raises(TenantExists, match="tenant 'acme' already exists"):
        store.create("acme")
    with pytest.raises(TenantExists):
        store.create("default")
    assert [t.name for t in store.list()] == ["default", "acme"]


def test_concurrent_creates_of_one_name_make_one_tenant(db: Database) -> None:
    store = TenantStore(db)

    def create(_: int) -> str:
        try:
            store.create("race")
            return "created"
        except TenantExists:
            return "exists"

    with ThreadPoolExecutor(4) as pool:
        outcomes = sorted(pool.map(create, range(4)))
    assert outcomes == ["created", "exists", "exists", "exists"]


@pytest.mark.parametrize(
    "name", ["a", "acme", "team-42", "ml.research", "x_y", "0day", "a" * 64, "9"]
)
def test_valid_names(db: Database, name: str) -> None:
    assert TenantStore(db).create(name).name == name


@pytest.mark.parametrize(
    "name",
    ["", "a" * 65, "Acme", "-acme", ".acme", "_acme", "has space", "acme/eng", "ünï", "acme\n"],
)
def test_invalid_names_raise_value_error(db: Database, name: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant name"):
        TenantStore(db).create(name)
    assert len(TenantStore(db).list()) == 1
