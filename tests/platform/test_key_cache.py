"""The API-key check's cache: one SQL lookup per key at a time, re-checked ahead of expiry,
and never trusted longer than KEY_CACHE_S (a real KeyStore on SQLite; the clock is ours)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError
from starlette.requests import Request

from hotpool.billing.db import Database
from hotpool.billing.keys import ApiKeyRecord, KeyStore, parse_scopes
from hotpool.billing.tenants import TenantStore
from hotpool.platform.auth import KEY_CACHE_S, KEY_REFRESH_S, Authenticator
from hotpool.platform.errors import APIError

GRACE_S = 60.0


class CountingKeys(KeyStore):
    """A real KeyStore that counts its lookups and can hold them until released."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.lookups = 0
        self.gate = threading.Event()
        self.gate.set()
        self.held: set[int] | None = None  # which lookups (1, 2, ...) the gate holds; all
        self.fail = False

    def authenticate(self, key: str) -> ApiKeyRecord | None:
        self.lookups += 1
        if self.held is None or self.lookups in self.held:
            assert self.gate.wait(10), "the test never released the lookup"
        if self.fail:
            raise OperationalError("SELECT", {}, ConnectionRefusedError("database is down"))
        return super().authenticate(key)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class World:
    keys: CountingKeys
    key: str  # the plaintext key
    key_id: int
    clock: Clock
    auth: Authenticator

    async def ask(self) -> int:
        """A request with the key: its tenant, or APIError."""
        return (await self.auth.principal(_request(self.key))).tenant_id

    def revoke(self) -> None:
        KeyStore(self.keys.db).revoke(self.key_id)


@pytest.fixture
def w(tmp_path: Path) -> Iterator[World]:
    db = Database(f"sqlite:///{tmp_path / 'ledger.db'}")
    db.upgrade()
    tenant = TenantStore(db).create("alpha")
    keys = CountingKeys(db)
    record, plaintext = keys.create(tenant.id, parse_scopes("invoke"))
    clock = Clock()
    try:
        auth = Authenticator(keys, True, clock=clock, timeout_s=0.2, grace_s=GRACE_S)
        yield World(keys, plaintext, record.id, clock, auth)
    finally:
        db.dispose()


def _request(key: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {key}".encode())]})


async def _until(condition: object, what: str) -> None:
    for _ in range(500):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_burst_on_a_cold_cache_sends_one_lookup(w: World) -> None:
    async def burst() -> list[int]:
        return await asyncio.gather(*(w.ask() for _ in range(32)))

    tenants = asyncio.run(burst())
    assert len(set(tenants)) == 1 and len(tenants) == 32
    assert w.keys.lookups == 1


def test_a_key_in_use_is_rechecked_in_the_background(w: World) -> None:
    async def run() -> None:
        await w.ask()
        assert w.keys.lookups == 1
        w.clock.now += KEY_REFRESH_S / 2  # fresh: no lookup at all
        await w.ask()
        assert w.keys.lookups == 1
        # Past the refresh age the request is answered from the cache while one lookup
        # (held here) runs behind it; more requests meanwhile start no second one.
        w.keys.gate.clear()
        w.clock.now += KEY_REFRESH_S
        for _ in range(5):
            await asyncio.wait_for(w.ask(), 1.0)
        await _until(lambda: w.keys.lookups == 2, "the background lookup")
        w.keys.gate.set()
        await _until(lambda: not w.auth._lookups, "the background lookup to finish")
        # The refreshed check counts from when its lookup started: past the first check's
        # expiry nobody waits and nothing is looked up again.
        w.clock.now += KEY_CACHE_S - KEY_REFRESH_S - 0.1
        await w.ask()
        assert w.keys.lookups == 2

    asyncio.run(run())


def test_a_key_revoked_elsewhere_fails_within_the_cache_time(w: World) -> None:
    async def run() -> None:
        await w.ask()
        w.revoke()  # the CLI, or another control plane
        w.clock.now += KEY_CACHE_S + 0.01  # idle meanwhile: no refresh ran
        with pytest.raises(APIError) as err:
            await w.ask()
        assert err.value.status == 401

    asyncio.run(run())


def test_a_refresh_that_finds_the_key_revoked_ends_it_at_once(w: World) -> None:
    async def run() -> None:
        await w.ask()
        w.revoke()
        w.clock.now += KEY_REFRESH_S + 0.01
        await w.ask()  # the cached check is still young enough
        await _until(lambda: not w.auth._lookups and w.keys.lookups == 2, "the refresh")
        with pytest.raises(APIError) as err:
            await w.ask()
        assert err.value.status == 401

    asyncio.run(run())


def test_a_lookup_in_flight_at_a_revocation_is_not_cached(w: World) -> None:
    async def run() -> None:
        w.keys.gate.clear()
        first = asyncio.ensure_future(w.ask())
        await _until(lambda: w.keys.lookups == 1, "the lookup")
        # It has read nothing yet, but a slower database could have read the key as
        # active before the revocation below committed: its answer must not be cached.
        w.auth.forget(w.key_id)
        w.keys.gate.set()
        await first
        w.revoke()
        with pytest.raises(APIError):
            await w.ask()
        assert w.keys.lookups == 2

    asyncio.run(run())


def test_a_revocation_through_the_api_does_not_wait_for_a_lookup_in_flight(w: World) -> None:
    async def run() -> None:
        await w.ask()
        # A background re-check starts and is held before it reads anything...
        w.keys.gate.clear()
        w.keys.held = {2}
        w.clock.now += KEY_REFRESH_S + 0.01
        await w.ask()
        await _until(lambda: w.keys.lookups == 2, "the background lookup")
        # ...the key is revoked through the API meanwhile: the next request must not
        # share the held lookup (which may have read the key as active) but ask again.
        w.revoke()
        w.auth.forget(w.key_id)
        with pytest.raises(APIError) as err:
            await asyncio.wait_for(w.ask(), 5)
        assert err.value.status == 401 and w.keys.lookups == 3
        w.keys.gate.set()
        await _until(lambda: not w.auth._lookups, "the held lookup")
        with pytest.raises(APIError):  # and the held lookup's late answer is not cached
            await w.ask()

    asyncio.run(run())


def test_a_caller_that_gives_up_does_not_cancel_the_others_lookup(w: World) -> None:
    async def run() -> int:
        w.keys.gate.clear()
        leaving = asyncio.ensure_future(w.ask())
        staying = asyncio.ensure_future(w.ask())
        await _until(lambda: w.keys.lookups == 1, "the lookup")
        leaving.cancel()
        await asyncio.sleep(0.02)
        w.keys.gate.set()
        return await asyncio.wait_for(staying, 5)

    assert asyncio.run(run()) > 0
    assert w.keys.lookups == 1


def test_a_failed_refresh_keeps_the_check_and_the_grace_period_keeps_it_longer(
    w: World, caplog: pytest.LogCaptureFixture
) -> None:
    async def run() -> None:
        await w.ask()
        w.keys.fail = True
        w.clock.now += KEY_REFRESH_S + 0.01
        await w.ask()
        await _until(lambda: not w.auth._lookups, "the refresh")
        assert "could not check an API key" in caplog.text
        await w.ask()  # still within KEY_CACHE_S
        w.clock.now += KEY_CACHE_S
        await w.ask()  # past it, the database down: honoured as last checked
        assert w.auth.served_from_grace >= 1 and w.auth.database_failing
        with pytest.raises(APIError) as err:  # a key never seen cannot be checked: 503
            await w.auth.principal(_request("hp_never_seen_0000000000"))
        assert err.value.status == 503 and err.value.retry_after_s == 5
        assert err.value.code == "auth_unavailable"
        w.clock.now += GRACE_S
        with pytest.raises(APIError) as err:  # past the grace period: 503 too
            await w.ask()
        assert err.value.status == 503
        w.keys.fail = False  # the database is back: checked again, and served
        await w.ask()
        assert not w.auth.database_failing

    asyncio.run(run())


def test_a_database_that_does_not_answer_costs_a_request_the_timeout_at_most(w: World) -> None:
    """A frozen database: the first request waits the timeout, then every key checked
    within the grace period is served at once (a revoked one still refused), one lookup at
    a time probes the database, and a key never seen is a 503 at once."""

    async def run() -> None:
        await w.ask()
        revoked_record, revoked = w.keys.create(
            w.keys.authenticate(w.key).tenant_id,
            parse_scopes("invoke"),  # type: ignore[union-attr]
        )
        await w.auth.principal(_request(revoked))
        KeyStore(w.keys.db).revoke(revoked_record.id)
        w.clock.now += KEY_CACHE_S - 0.01  # the revocation is seen by a refresh...
        await w.auth.principal(_request(revoked))
        await _until(lambda: not w.auth._lookups, "the refresh")
        w.keys.gate.clear()  # ...and then the database stops answering
        w.clock.now += KEY_CACHE_S + 0.01
        lookups = w.keys.lookups
        t0 = time.monotonic()
        assert await w.ask() > 0  # waited for the timeout, then served from the grace period
        assert 0.2 <= time.monotonic() - t0 < 2 and w.auth.database_failing
        t0 = time.monotonic()
        for _ in range(20):
            await w.ask()
        with pytest.raises(APIError) as err:
            await w.auth.principal(_request(revoked))
        assert err.value.status == 401  # revoked as last seen
        with pytest.raises(APIError) as err:
            await w.auth.principal(_request("hp_never_seen_0000000000"))
        assert err.value.status == 503
        assert time.monotonic() - t0 < 0.2  # nobody waited on the database again
        assert w.keys.lookups == lookups + 1  # and no lookup was stacked on the first one
        w.keys.gate.set()
        await _until(lambda: not w.auth._lookups, "the held lookup")
        assert not w.auth.database_failing

    asyncio.run(run())


def test_unknown_keys_are_remembered_but_never_push_out_real_ones(
    w: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused key is cached (a 401, not a 503, while the database is down), and a revocation
    with refused keys cached works; a flood of made-up keys stops being cached at the
    bound instead of clearing the real keys the grace period would serve from."""
    monkeypatch.setattr("hotpool.platform.auth.MAX_CACHED_KEYS", 4)
    made_up = [f"hp_{'x' * 39}{i}" for i in range(8)]

    async def run() -> None:
        await w.ask()
        for key in made_up:
            with pytest.raises(APIError) as err:
                await w.auth.principal(_request(key))
            assert err.value.status == 401
        assert len(w.auth._cache) == 4 and sum(c.key is not None for c in w.auth._cache.values())
        lookups = w.keys.lookups
        with pytest.raises(APIError):  # remembered: no second lookup
            await w.auth.principal(_request(made_up[0]))
        assert w.keys.lookups == lookups
        w.auth.forget(w.key_id)  # with refused keys in the cache
        w.keys.fail = True
        w.clock.now += KEY_CACHE_S
        with pytest.raises(APIError) as err:  # the database down: a remembered refusal holds
            await w.auth.principal(_request(made_up[1]))
        assert err.value.status == 401

    asyncio.run(run())
