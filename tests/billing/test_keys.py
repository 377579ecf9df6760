from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import insert, inspect, select
from sqlalchemy.exc import IntegrityError

from hotpool.billing import keys as keys_module
from hotpool.billing.db import Database
from hotpool.billing.keys import (
    KEY_LEN,
    PREFIX_LEN,
    SCOPES,
    ApiKeyRecord,
    KeyStore,
    parse_scopes,
)
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import DEFAULT_TENANT_ID, ApiKey
from hotpool.billing.tenants import TenantStore

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def store(db: Database) -> KeyStore:
    return KeyStore(db)


@pytest.fixture
def acme(db: Database) -> int:
    return TenantStore(db).create("acme").id


def _rows(db: Database) -> list[dict[str, Any]]:
    with db.engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(select(ApiKey.__table__))]


# --- creating and authenticating ---------------------------------------------------------


def test_create_returns_the_record_and_the_key(store: KeyStore, acme: int) -> None:
    before = datetime.now(UTC)
    record, key = store.create(acme, "invoke,deploy", name="ci")
    after = datetime.now(UTC)

    assert key.startswith("hp_") and len(key) == KEY_LEN == 43
    assert key[3:].isascii() and key[3:].isalnum()
    assert record.prefix == key[:PREFIX_LEN] and len(record.prefix) == 11
    assert "_" not in record.prefix[3:]
    assert record.tenant_id == acme and record.name == "ci"
    assert record.scopes == frozenset({"deploy", "invoke"})
    assert before <= record.created_at <= after and record.created_at.tzinfo is UTC
    assert record.last_used_at is None and record.revoked_at is None and record.active


def test_only_a_digest_of_the_key_is_stored(db: Database, store: KeyStore) -> None:
    _, key = store.create(DEFAULT_TENANT_ID, ["usage"])
    [row] = _rows(db)
    assert row["key_hash"] == hashlib.sha256(key.encode()).hexdigest()
    assert row["prefix"] == key[:11]
    assert not any(isinstance(v, str) and key in v for v in row.values())


def test_the_key_never_reaches_the_logs(store: KeyStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    # SQLAlchemy then logs every statement and its parameters.
    caplog.set_level(logging.INFO, logger="sqlalchemy.engine")
    record, key = store.create(DEFAULT_TENANT_ID, "invoke")
    assert store.authenticate(key) == record
    assert record.prefix in caplog.text  # the statements were logged...
    assert key not in caplog.text  # ...but not the key


def test_authenticate_round_trip(store: KeyStore, acme: int) -> None:
    record, key = store.create(acme, {"invoke"})
    other, other_key = store.create(DEFAULT_TENANT_ID, {"admin"}, name="ops")
    assert store.authenticate(key) == record
    assert store.authenticate(other_key) == other
    assert store.authenticate(key) != other


def test_keys_are_random(store: KeyStore) -> None:
    made = [store.create(DEFAULT_TENANT_ID, "invoke") for _ in range(20)]
    assert len({key for _, key in made}) == 20
    assert len({record.prefix for record, _ in made}) == 20


def _garbage(key: str) -> Iterator[str]:
    yield ""
    yield " "
    yield "hp_"
    yield key[:PREFIX_LEN]  # the prefix alone
    yield key[:-1]
    yield key + "x"
    yield key + "\n"
    yield " " + key
    yield key.upper() if key[3:] != key[3:].upper() else key.lower()
    yield "sk_" + key[3:]
    yield key[:-1] + ("A" if key[-1] != "A" else "B")  # right prefix, wrong secret
    yield key[:-1] + "\x00"
    yield key[:-1] + "é"
    yield "hp_" + "ü" * 40
    yield "hp_" + "٣" * 40  # Arabic-Indic digits: str.isalnum() says yes, the alphabet no
    yield "hp_" + "\ud800" * 40  # a lone surrogate cannot even be encoded
    yield "🔑" * KEY_LEN
    yield "Bearer " + key
    yield "x" * 1_000_000
    yield key * 1000


def test_wrong_malformed_and_hostile_keys_are_none(store: KeyStore) -> None:
    _, key = store.create(DEFAULT_TENANT_ID, "invoke")
    for candidate in _garbage(key):
        assert store.authenticate(candidate) is None, repr(candidate[:60])
    assert store.authenticate(key) is not None


@pytest.mark.parametrize("value", [None, 42, b"hp_", ["hp_"]])
def test_non_strings_are_none(store: KeyStore, value: Any) -> None:
    assert store.authenticate(value) is None


def test_an_unknown_but_well_formed_key_is_none(store: KeyStore) -> None:
    store.create(DEFAULT_TENANT_ID, "invoke")
    assert store.authenticate("hp_" + "a" * 40) is None


def test_create_refuses_bad_input(store: KeyStore, db: Database) -> None:
    with pytest.raises(ValueError, match="tenant 999 does not exist"):
        store.create(999, "invoke")
    with pytest.raises(ValueError, match="unknown scope 'everything'"):
        store.create(DEFAULT_TENANT_ID, "everything")
    with pytest.raises(ValueError, match="unknown scope 'root'"):
        store.create(DEFAULT_TENANT_ID, ["invoke", "root"])
    with pytest.raises(ValueError, match="no scopes"):
        store.create(DEFAULT_TENANT_ID, [])
    with pytest.raises(ValueError, match="name must be 1 to 128"):
        store.create(DEFAULT_TENANT_ID, "invoke", name="x" * 129)
    with pytest.raises(ValueError, match="name must be 1 to 128"):
        store.create(DEFAULT_TENANT_ID, "invoke", name="")
    assert _rows(db) == []


def test_scopes_are_stored_in_sorted_order(db: Database, store: KeyStore) -> None:
    store.create(DEFAULT_TENANT_ID, "usage, invoke,deploy,admin")
    [row] = _rows(db)
    assert row["scopes"] == "admin,deploy,invoke,usage"


# --- prefixes ------------------------------------------------------------------------


def test_the_database_refuses_a_second_key_with_the_same_prefix(
    db: Database, store: KeyStore
) -> None:
    record, _ = store.create(DEFAULT_TENANT_ID, "invoke")
    row = {
        "tenant_id": DEFAULT_TENANT_ID,
        "prefix": record.prefix,
        "key_hash": "0" * 64,
        "scopes": "invoke",
        "created_at": T0,
    }
    with pytest.raises(IntegrityError), db.engine.begin() as conn:
        conn.execute(insert(ApiKey), row)


def test_a_prefix_clash_draws_a_new_key(store: KeyStore, monkeypatch: pytest.MonkeyPatch) -> None:
    first = "hp_SamePref" + "a" * 32
    clash = "hp_SamePref" + "b" * 32
    fresh = "hp_OtherPre" + "c" * 32
    drawn = iter([first, clash, fresh])
    monkeypatch.setattr(keys_module, "_new_key", lambda: next(drawn))

    a, key_a = store.create(DEFAULT_TENANT_ID, "invoke")
    b, key_b = store.create(DEFAULT_TENANT_ID, "invoke")
    assert (key_a, key_b) == (first, fresh)
    assert (a.prefix, b.prefix) == ("hp_SamePref", "hp_OtherPre")
    assert store.authenticate(clash) is None
    assert store.authenticate(fresh) == b


# --- scopes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("invoke", {"invoke"}),
        ("deploy,invoke", {"deploy", "invoke"}),
        (" invoke , usage ", {"invoke", "usage"}),
        ("invoke,invoke", {"invoke"}),
        ("deploy,invoke,usage,admin,operator", set(SCOPES)),
        ("admin,", {"admin"}),
    ],
)
def test_parse_scopes(text: str, expected: set[str]) -> None:
    assert parse_scopes(text) == frozenset(expected)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no scopes given"),
        (" , ,", "no scopes given"),
        ("invoke,write", "unknown scope 'write'"),
        ("Invoke", "unknown scope 'Invoke'"),
        ("invoke;usage", "unknown scope 'invoke;usage'"),
    ],
)
def test_parse_scopes_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_scopes(text)
    assert "deploy, invoke, usage, admin" in str(info.value)


def _key(scopes: set[str], revoked_at: datetime | None = None) -> ApiKeyRecord:
    return ApiKeyRecord(1, 1, None, "hp_abcdefgh", frozenset(scopes), T0, None, revoked_at)


def test_allows() -> None:
    invoker = _key({"invoke", "usage"})
    assert invoker.allows("invoke") and invoker.allows("usage")
    assert not invoker.allows("deploy") and not invoker.allows("admin")
    admin = _key({"admin"})
    assert all(admin.allows(scope) for scope in SCOPES if scope != "operator")
    assert not admin.allows("operator")  # its own tenant only: no reach across tenants
    operator = _key({"operator"})
    assert all(operator.allows(scope) for scope in SCOPES)
    revoked = _key({"operator"}, revoked_at=T0)
    assert not revoked.active
    assert not any(revoked.allows(scope) for scope in SCOPES)
    with pytest.raises(ValueError, match="unknown scope 'invok'"):
        admin.allows("invok")


# --- revoking ------------------------------------------------------------------------


def test_a_revoked_key_no_longer_authenticates(store: KeyStore) -> None:
    record, key = store.create(DEFAULT_TENANT_ID, "invoke")
    before = datetime.now(UTC)
    revoked = store.revoke(record.prefix)
    assert revoked.id == record.id and not revoked.active
    assert revoked.revoked_at is not None and revoked.revoked_at >= before
    assert store.authenticate(key) is None


def test_revoke_is_idempotent(store: KeyStore) -> None:
    record, _ = store.create(DEFAULT_TENANT_ID, "invoke")
    first = store.revoke(record.prefix)
    assert store.revoke(record.prefix) == first
    assert store.revoke(record.id) == first


def test_revoke_by_id_or_whole_key_touches_only_that_key(store: KeyStore) -> None:
    a, key_a = store.create(DEFAULT_TENANT_ID, "invoke")
    b, key_b = store.create(DEFAULT_TENANT_ID, "invoke")
    c, key_c = store.create(DEFAULT_TENANT_ID, "invoke")
    assert store.revoke(a.id).prefix == a.prefix
    assert store.revoke(key_b).id == b.id
    assert store.authenticate(key_a) is None and store.authenticate(key_b) is None
    assert store.authenticate(key_c) == c


@pytest.mark.parametrize("missing", ["hp_nothere", "hp_Nothere1", 12345, "", "a\x00", True])
def test_revoking_an_unknown_key_raises_key_error(store: KeyStore, missing: Any) -> None:
    store.create(DEFAULT_TENANT_ID, "invoke")
    with pytest.raises(KeyError):
        store.revoke(missing)


# --- listing and last use --------------------------------------------------------------


def test_list_is_newest_first_and_filters_by_tenant(store: KeyStore, acme: int) -> None:
    store.create(DEFAULT_TENANT_ID, "invoke", name="a")
    b, _ = store.create(acme, "deploy", name="b")
    store.create(acme, "usage", name="c")
    store.revoke(b.prefix)
    assert [k.name for k in store.list()] == ["c", "b", "a"]
    assert [k.name for k in store.list(acme)] == ["c", "b"]
    assert [k.name for k in store.list(DEFAULT_TENANT_ID)] == ["a"]
    assert store.list(999) == []
    assert [k.active for k in store.list()] == [True, False, True]


def test_touch_records_the_last_use(store: KeyStore) -> None:
    record, key = store.create(DEFAULT_TENANT_ID, "invoke")
    other, _ = store.create(DEFAULT_TENANT_ID, "invoke")
    before = datetime.now(UTC)
    store.touch(record.id)
    seen = store.authenticate(key)
    assert seen is not None and seen.last_used_at is not None
    assert before <= seen.last_used_at <= datetime.now(UTC)

    later = datetime(2025, 3, 1, 14, 30, tzinfo=timezone(timedelta(hours=2)))
    store.touch(record.id, later)
    by_id = {k.id: k for k in store.list()}
    assert by_id[record.id].last_used_at == datetime(2025, 3, 1, 12, 30, tzinfo=UTC)
    assert by_id[other.id].last_used_at is None


def test_touch_refuses_unknown_ids_and_naive_times(store: KeyStore) -> None:
    record, _ = store.create(DEFAULT_TENANT_ID, "invoke")
    with pytest.raises(KeyError):
        store.touch(record.id + 100)
    with pytest.raises(ValueError, match="timezone-aware"):
        store.touch(record.id, datetime(2025, 3, 1, 12, 0))


# --- the ledger and the migration ------------------------------------------------------


def _usage(request_id: str, **overrides: Any) -> UsageRecord:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "deployment": "smollm2",
        "endpoint": "chat.completions",
        "status": "completed",
        "prompt_tokens": 12,
        "completion_tokens": 7,
        "created_at": T0,
    }
    return UsageRecord(**{**fields, **overrides})


def test_usage_events_keep_the_key_they_were_made_with(db: Database, store: KeyStore) -> None:
    record, _ = store.create(DEFAULT_TENANT_ID, "invoke")
    ledger = Ledger(db)
    ledger.record(_usage("with-key", api_key_id=record.id))
    ledger.record(_usage("without-key", created_at=T0 + timedelta(seconds=1)))
    store.revoke(record.prefix)  # events outlive their key
    events = ledger.events()
    assert [(e.request_id, e.api_key_id) for e in events] == [
        ("without-key", None),
        ("with-key", record.id),
    ]
    # Not a foreign key: an id of a key that is not (or no longer) there is kept as it is.
    ledger.record(_usage("stale-key", api_key_id=4242, created_at=T0 + timedelta(seconds=2)))
    assert ledger.events(limit=1)[0].api_key_id == 4242


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1"])
def test_usage_record_refuses_a_bad_key_id(bad: Any) -> None:
    with pytest.raises(ValueError, match="api_key_id"):
        _usage("r", api_key_id=bad)


def test_migration_0003_up_and_down(db: Database, store: KeyStore) -> None:
    store.create(DEFAULT_TENANT_ID, "invoke")
    Ledger(db).record(_usage("kept"))

    db.downgrade("0002")
    insp = inspect(db.engine)
    assert "api_keys" not in insp.get_table_names()
    assert "api_key_id" not in {c["name"] for c in insp.get_columns("usage_events")}
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT request_id FROM usage_events").scalars().all() == [
            "kept"
        ]

    db.upgrade()
    assert db.current_revision() == "0011"
    assert store.list() == []
    [event] = Ledger(db).events()
    assert (event.request_id, event.api_key_id) == ("kept", None)


def test_api_keys_constraint_names_follow_the_convention(db: Database) -> None:
    insp = inspect(db.engine)
    indexes = {ix["name"]: ix for ix in insp.get_indexes("api_keys")}
    assert set(indexes) == {"ix_api_keys_prefix", "ix_api_keys_tenant_id"}
    assert indexes["ix_api_keys_prefix"]["unique"]
    assert not indexes["ix_api_keys_tenant_id"]["unique"]
    assert {fk["name"] for fk in insp.get_foreign_keys("api_keys")} == {
        "fk_api_keys_tenant_id_tenants"
    }
    assert insp.get_pk_constraint("api_keys")["name"] in ("pk_api_keys", None)  # SQLite: None
    usage_fks = {fk["name"] for fk in insp.get_foreign_keys("usage_events")}
    assert usage_fks == {"fk_usage_events_tenant_id_tenants"}
