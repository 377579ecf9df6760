"""API keys, scopes and tenant isolation over every public route (the real app, a real
SQLite database; no request here reaches a worker: each one is decided before that)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from snapshot_folders import snapshot_folder
from starlette.testclient import TestClient

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore, parse_scopes
from hotpool.billing.ledger import UsageRecord
from hotpool.billing.scale_events import ScaleEventRecord
from hotpool.billing.tenants import TenantStore
from hotpool.platform.app import build_services, create_app
from hotpool.platform.services import Services
from hotpool.pool.local import LocalProcessBackend, LocalWorkerConfig
from hotpool.settings import load_settings

ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class World:
    client: TestClient
    services: Services
    keys: dict[str, str]  # "<tenant>:<scopes>" -> plaintext key
    snapshot: Path

    def h(self, who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[who]}"}


def _services(home: Path, auth: str) -> Services:
    settings = load_settings(
        {"HOTPOOL_HOME": str(home), "HOTPOOL_WARM_WORKERS": "0", "HOTPOOL_AUTH": auth}
    )
    db = Database(settings.database_url)
    db.upgrade()
    backend = LocalProcessBackend(
        LocalWorkerConfig("http://127.0.0.1:9", "t", settings.cache_dir, home / "logs")
    )
    return build_services(settings, db, backend, "t")


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    services = _services(tmp_path, "keys")
    tenants, keystore = TenantStore(services.db), KeyStore(services.db)
    keys = {}
    for tenant in ("alpha", "beta"):
        t = tenants.create(tenant)
        for scopes in ("deploy", "invoke", "usage", "admin", "deploy,invoke,usage", "operator"):
            _, keys[f"{tenant}:{scopes}"] = keystore.create(t.id, parse_scopes(scopes))
    snapshot = snapshot_folder(tmp_path / "objects" / "snapshots" / "tiny")
    try:
        with TestClient(create_app(services)) as client:
            w = World(client, services, keys, snapshot)
            for tenant in ("alpha", "beta"):
                body = {"name": f"{tenant}-model", "snapshot_uri": f"file://{snapshot}"}
                r = client.post("/v1/deployments", json=body, headers=w.h(f"{tenant}:deploy"))
                assert r.status_code == 201, r.text
            yield w
    finally:
        services.db.dispose()


def _error(r: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS
    if code is not None:
        assert err["code"] == code, err
    return err  # type: ignore[no-any-return]


# Every public route, with the scope it needs and a body that would pass validation.
def _routes(target: str) -> list[tuple[str, str, str, Any]]:
    chat = {"model": target, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    return [
        ("deploy", "GET", "/v1/deployments", None),
        ("deploy", "GET", f"/v1/deployments/{target}", None),
        ("deploy", "GET", f"/v1/deployments/{target}/events", None),
        ("invoke", "POST", "/v1/chat/completions", chat),
        ("invoke", "POST", "/v1/completions", {"model": target, "prompt": "x", "max_tokens": 0}),
        (
            "invoke",
            "POST",
            f"/v1/deployments/{target}/invoke",
            {"prompt": "x", "params": {"max_tokens": 0}},
        ),
        ("invoke", "GET", "/v1/models", None),
        ("invoke", "GET", f"/v1/models/{target}", None),
        ("usage", "GET", "/v1/usage", None),
        ("usage", "GET", "/v1/usage/summary", None),
        ("operator", "GET", "/v1/tenants", None),
        ("admin", "GET", "/v1/keys", None),
    ]


@pytest.mark.parametrize("route", range(len(_routes("x"))))
def test_no_key_or_a_bad_key_is_401(world: World, route: int) -> None:
    _, method, path, body = _routes("alpha-model")[route]
    bad = [{}, {"authorization": "Bearer "}, {"authorization": "Basic abc"},
           {"authorization": "Bearer hp_nope"}, {"authorization": "Bearer " + "x" * 5000},
           {"authorization": world.keys["alpha:admin"]}]  # fmt: skip
    for headers in bad:
        r = world.client.request(method, path, json=body, headers=headers)
        err = _error(r, 401)
        assert err["code"] in ("missing_api_key", "invalid_api_key")
        assert world.keys["alpha:admin"] not in r.text  # a key is never echoed whole


@pytest.mark.parametrize("route", range(len(_routes("x"))))
def test_each_route_needs_its_scope_and_admin_has_all_but_operator(
    world: World, route: int
) -> None:
    scope, method, path, body = _routes("alpha-model")[route]
    for held in ("deploy", "invoke", "usage", "admin", "operator"):
        r = world.client.request(method, path, json=body, headers=world.h(f"alpha:{held}"))
        if held == scope or held == "operator" or (held == "admin" and scope != "operator"):
            assert r.status_code in (200, 400), r.text  # 400: the deliberate max_tokens=0
        else:
            _error(r, 403, "insufficient_scope")


def test_another_tenants_deployment_does_not_exist_for_you(world: World) -> None:
    own = world.h("alpha:deploy,invoke,usage")
    for scope, method, path, body in _routes("beta-model"):
        if "beta-model" not in path and not (body and body.get("model") == "beta-model"):
            continue
        if body is not None:  # valid, so the answer is about the model, not the body
            body = {**body, "params": {}} if "params" in body else {**body, "max_tokens": 1}
        r = world.client.request(method, path, json=body, headers=own)
        assert r.status_code == 404, (scope, path, r.text)
        assert "beta" in r.json()["error"]["message"]  # names what you asked for, no more
    listed = world.client.get("/v1/deployments", headers=own).json()["data"]
    assert [d["name"] for d in listed] == ["alpha-model"]
    models = world.client.get("/v1/models", headers=own).json()["data"]
    assert [m["id"] for m in models] == ["alpha-model"]


def test_deployments_are_created_in_the_callers_tenant(world: World) -> None:
    spec = world.services.catalog.get("beta-model")
    assert spec is not None
    beta = TenantStore(world.services.db).by_name("beta")
    assert beta is not None and spec.tenant_id == beta.id
    # A name is unique across tenants: taking beta's is a conflict for alpha.
    body = {"name": "beta-model", "snapshot_uri": f"file://{world.snapshot}"}
    r = world.client.post("/v1/deployments", json=body, headers=world.h("alpha:deploy"))
    _error(r, 409, "deployment_exists")


def test_usage_is_the_tenants_own_and_the_operator_sees_all(world: World) -> None:
    tenants = {t.name: t.id for t in TenantStore(world.services.db).list()}
    for tenant, tokens in (("alpha", 10), ("beta", 1000)):
        world.services.ledger.record(
            UsageRecord(
                f"req-{tenant}",
                f"{tenant}-model",
                "completions",
                "completed",
                tokens,
                tokens,
                tenant_id=tenants[tenant],
            )
        )

    def total(who: str) -> int:
        r = world.client.get("/v1/usage", headers=world.h(who))
        assert r.status_code == 200, r.text
        return sum(x["input_tokens"] for b in r.json()["data"] for x in b["results"])

    assert total("alpha:usage") == 10
    assert total("beta:usage") == 1000
    assert total("alpha:admin") == 10  # a tenant's admin: its own tenant's
    assert total("alpha:operator") == 1010

    def summary(who: str, **params: str) -> list[str]:
        r = world.client.get("/v1/usage/summary", params=params, headers=world.h(who))
        assert r.status_code == 200, r.text
        return [d["name"] for d in r.json()["deployments"]]

    assert summary("alpha:usage") == ["alpha-model"]
    assert summary("beta:usage") == ["beta-model"]
    assert summary("alpha:admin") == ["alpha-model"]
    assert summary("alpha:operator") == ["alpha-model", "beta-model"]
    # An operator narrows to one tenant; anyone may name their own; another's is a 404,
    # worded as for a tenant that does not exist.
    assert summary("alpha:operator", tenant="beta") == ["beta-model"]
    assert summary("alpha:usage", tenant="alpha") == ["alpha-model"]
    for path in ("/v1/usage", "/v1/usage/summary"):
        for name in ("beta", "nobody"):
            r = world.client.get(path, params={"tenant": name}, headers=world.h("alpha:usage"))
            assert _error(r, 404, "tenant_not_found")["message"] == f"tenant {name!r} not found"
    r = world.client.get("/v1/usage", params={"tenant": "beta"}, headers=world.h("alpha:operator"))
    assert sum(x["input_tokens"] for b in r.json()["data"] for x in b["results"]) == 1000


def test_a_reused_name_shows_none_of_the_old_deployments_scale_events(world: World) -> None:
    alpha = world.services.catalog.tenant_of("alpha-model")
    world.services.scale_events.store.record(
        ScaleEventRecord("alpha-model", 0, 1, "request", tenant_id=alpha)
    )
    events = "/v1/deployments/alpha-model/events"
    assert len(world.client.get(events, headers=world.h("alpha:deploy")).json()["data"]) == 1
    r = world.client.delete("/v1/deployments/alpha-model", headers=world.h("alpha:deploy"))
    assert r.status_code == 200
    body = {"name": "alpha-model", "snapshot_uri": f"file://{world.snapshot}"}
    r = world.client.post("/v1/deployments", json=body, headers=world.h("beta:deploy"))
    assert r.status_code == 201, r.text
    # Beta's new deployment of that name has no history yet; alpha's is not beta's to see.
    assert world.client.get(events, headers=world.h("beta:deploy")).json()["data"] == []


def test_revoked_key_fails_at_once(world: World) -> None:
    headers = world.h("alpha:admin")
    key = world.keys["alpha:deploy"]
    assert world.client.get("/v1/deployments", headers=world.h("alpha:deploy")).status_code == 200
    prefix = next(
        k["prefix"]
        for k in world.client.get("/v1/keys", headers=headers).json()["data"]
        if key.startswith(k["prefix"])
    )
    r = world.client.delete(f"/v1/keys/{prefix}", headers=headers)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    _error(world.client.get("/v1/deployments", headers=world.h("alpha:deploy")), 401)
    _error(world.client.delete("/v1/keys/hp_unknown00", headers=headers), 404)


def test_operator_creates_tenants_and_keys_shown_once(world: World) -> None:
    admin = world.h("alpha:operator")
    r = world.client.post("/v1/tenants", json={"name": "gamma"}, headers=admin)
    assert r.status_code == 201 and r.json()["name"] == "gamma"
    _error(world.client.post("/v1/tenants", json={"name": "gamma"}, headers=admin), 409)
    _error(world.client.post("/v1/tenants", json={"name": "Bad Name!"}, headers=admin), 400)
    body = {"tenant": "gamma", "scopes": ["invoke"], "name": "ci"}
    r = world.client.post("/v1/keys", json=body, headers=admin)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["key"].startswith("hp_") and created["scopes"] == ["invoke"]
    listed = world.client.get("/v1/keys", headers=admin).text
    assert created["key"] not in listed and created["prefix"] in listed
    # The new key works for its scope, in its (empty) tenant.
    gamma = {"authorization": f"Bearer {created['key']}"}
    assert world.client.get("/v1/models", headers=gamma).json()["data"] == []
    _error(world.client.get("/v1/deployments", headers=gamma), 403, "insufficient_scope")
    bad = [{"tenant": "nobody", "scopes": ["invoke"]}, {"tenant": "gamma", "scopes": ["root"]},
           {"tenant": "gamma", "scopes": []}, {"tenant": "gamma", "scopes": "invoke"},
           {"tenant": "gamma", "scopes": ["invoke,admin"]}]  # fmt: skip
    for b in bad:
        assert world.client.post("/v1/keys", json=b, headers=admin).status_code in (400, 404)


def test_last_used_is_recorded(world: World) -> None:
    key = world.keys["alpha:invoke"]
    assert world.client.get("/v1/models", headers=world.h("alpha:invoke")).status_code == 200
    keystore = KeyStore(world.services.db)
    deadline = 50
    while deadline:
        (record,) = [k for k in keystore.list() if key.startswith(k.prefix)]
        if record.last_used_at is not None:
            break
        deadline -= 1
        time.sleep(0.05)
    assert record.last_used_at is not None


def test_local_mode_needs_no_key_and_says_so(tmp_path: Path) -> None:
    services = _services(tmp_path, "none")
    try:
        with TestClient(create_app(services)) as client:
            r = client.get("/v1/models")
            assert r.status_code == 200
            assert r.headers["x-hotpool-auth"] == "off"
    finally:
        services.db.dispose()


def test_an_admin_manages_its_own_tenants_keys_only(world: World) -> None:
    """Issue 46: beta's admin minted a key in alpha (201), then changed alpha's deployment
    with it. An admin now acts in its own tenant: another tenant is as unknown as a name
    that does not exist, its keys cannot be seen or revoked, and no operator key is made."""
    beta = world.h("beta:admin")
    for body in (
        {"tenant": "alpha", "scopes": ["deploy"]},
        {"tenant": "nobody", "scopes": ["invoke"]},
    ):
        err = _error(
            world.client.post("/v1/keys", json=body, headers=beta), 404, "tenant_not_found"
        )
        assert err["message"] == f"tenant {body['tenant']!r} does not exist"
    _error(world.client.post("/v1/tenants", json={"name": "x"}, headers=beta), 403)
    _error(world.client.get("/v1/tenants", headers=beta), 403, "insufficient_scope")
    escalate = {"scopes": ["operator"]}
    _error(world.client.post("/v1/keys", json=escalate, headers=beta), 403, "insufficient_scope")
    # Its own tenant (the default), its own keys.
    r = world.client.post("/v1/keys", json={"scopes": ["invoke"], "name": "b"}, headers=beta)
    assert r.status_code == 201 and r.json()["tenant"] == "beta", r.text
    listed = world.client.get("/v1/keys", headers=beta).json()["data"]
    assert listed and {k["tenant"] for k in listed} == {"beta"}
    alpha_key = world.keys["alpha:deploy"]
    _error(world.client.delete(f"/v1/keys/{alpha_key[:11]}", headers=beta), 404)
    assert world.client.get("/v1/deployments", headers=world.h("alpha:deploy")).status_code == 200
    # Usage: its own tenant's, and another's is a 404 (an operator sees every tenant's).
    r = world.client.get("/v1/usage", params={"tenant": "alpha"}, headers=beta)
    _error(r, 404, "tenant_not_found")
    operator = world.h("alpha:operator")
    r = world.client.get("/v1/usage", params={"tenant": "beta"}, headers=operator)
    assert r.status_code == 200, r.text
    r = world.client.delete(f"/v1/keys/{alpha_key[:11]}", headers=operator)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
