"""``/v1/prices`` as a client sees it (the real app with keys on, a real SQLite ledger), and
the cost it puts into ``GET /v1/usage``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore, parse_scopes
from hotpool.billing.ledger import UsageRecord
from hotpool.billing.tenants import TenantStore
from hotpool.platform.app import build_services, create_app
from hotpool.platform.services import Services
from hotpool.pool.local import LocalProcessBackend, LocalWorkerConfig
from hotpool.settings import load_settings

T0 = datetime(2025, 3, 1, tzinfo=UTC)
TS0 = int(T0.timestamp())
PRICE = {"input": 150_000, "cached_input": 75_000, "output": 600_000}


@dataclass
class Api:
    client: TestClient
    services: Services
    keys: dict[str, str]

    def h(self, who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[who]}"}

    def post(self, body: Any, who: str = "admin") -> Any:
        return self.client.post("/v1/prices", json=body, headers=self.h(who))

    def get(self, who: str = "admin", **params: Any) -> Any:
        return self.client.get("/v1/prices", params=params, headers=self.h(who))


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    settings = load_settings(
        {"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_WARM_WORKERS": "0", "HOTPOOL_AUTH": "keys"}
    )
    db = Database(settings.database_url)
    db.upgrade()
    backend = LocalProcessBackend(
        LocalWorkerConfig("http://127.0.0.1:9", "t", settings.cache_dir, tmp_path / "logs")
    )
    services = build_services(settings, db, backend, "t")
    acme = TenantStore(db).create("acme")
    store = KeyStore(db)
    keys = {}
    for who, tenant, scopes in [
        ("admin", 1, "admin"),
        ("usage", 1, "usage"),
        ("deploy", 1, "deploy,invoke,usage"),
        ("acme", acme.id, "usage"),
    ]:
        _, keys[who] = store.create(tenant, parse_scopes(scopes))
    try:
        with TestClient(create_app(services)) as client:
            yield Api(client, services, keys)
    finally:
        db.dispose()


def _error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]  # type: ignore[no-any-return]


def test_admin_sets_and_lists_prices(api: Api) -> None:
    r = api.post({**PRICE, "effective_from": TS0})
    assert r.status_code == 201, r.text
    default = r.json()
    assert default == {
        "object": "price",
        "id": default["id"],
        "deployment": None,
        "currency": "USD",
        **PRICE,
        "effective_from": TS0,
        "created_at": default["created_at"],
    }
    own = api.post({**PRICE, "deployment": "smollm2", "input": 100_000, "currency": "USD"})
    assert own.status_code == 201, own.text
    assert own.json()["deployment"] == "smollm2"
    assert abs(own.json()["effective_from"] - datetime.now(UTC).timestamp()) < 60  # now

    listed = api.get().json()
    assert listed["object"] == "list"
    assert [(p["deployment"], p["input"]) for p in listed["data"]] == [
        (None, 150_000),
        ("smollm2", 100_000),
    ]
    assert [p["deployment"] for p in api.get(deployment="smollm2").json()["data"]] == ["smollm2"]
    assert api.get(deployment="other").json()["data"] == []


@pytest.mark.parametrize("who", ["usage", "deploy", "acme"])
def test_prices_need_the_admin_scope(api: Api, who: str) -> None:
    assert _error(api.post(PRICE, who), 403)["code"] == "insufficient_scope"
    assert _error(api.get(who), 403)["code"] == "insufficient_scope"


def test_prices_need_a_key(api: Api) -> None:
    assert _error(api.client.get("/v1/prices"), 401)["code"] == "missing_api_key"
    r = api.client.post("/v1/prices", json=PRICE)
    assert _error(r, 401)["code"] == "missing_api_key"
    assert api.get().json()["data"] == []  # nothing was set


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"cached_input": 1, "output": 1}, "input"),
        ({**PRICE, "input": -1}, "input"),
        ({**PRICE, "input": 0.15}, "input"),
        ({**PRICE, "input": "0.15"}, "input"),
        ({**PRICE, "cached_input": True}, "cached_input"),
        ({**PRICE, "output": 10**12 + 1}, "output"),
        ({**PRICE, "output": None}, "output"),
        ({**PRICE, "deployment": ""}, "deployment"),
        ({**PRICE, "deployment": "has space"}, "deployment"),
        ({**PRICE, "deployment": "nul\u0000"}, "deployment"),
        ({**PRICE, "deployment": 5}, "deployment"),
        ({**PRICE, "currency": "usd"}, "currency"),
        ({**PRICE, "currency": "US"}, "currency"),
        ({**PRICE, "currency": None}, "currency"),
        ({**PRICE, "effective_from": "2025-03-01"}, "effective_from"),
        ({**PRICE, "effective_from": -1}, "effective_from"),
        ({**PRICE, "effective_from": 10**20}, "effective_from"),
        ({**PRICE, "effective_from": 1.5}, "effective_from"),
        ({**PRICE, "price": 1}, "price"),
    ],
)
def test_bad_price_bodies_are_400_naming_the_field(
    api: Api, body: dict[str, Any], param: str
) -> None:
    err = _error(api.post(body), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert api.get().json()["data"] == []


def test_bad_price_requests_are_400(api: Api) -> None:
    assert _error(api.post([PRICE]), 400)["message"] == "the request body must be a JSON object"
    r = api.client.post("/v1/prices", content=b"{", headers=api.h("admin"))
    assert "not valid JSON" in _error(r, 400)["message"]
    assert _error(api.get(at="1"), 400)["param"] == "at"
    assert _error(api.get(deployment="a b"), 400)["param"] == "deployment"


def test_conflicting_prices_are_409(api: Api) -> None:
    assert api.post({**PRICE, "effective_from": TS0}).status_code == 201
    err = _error(api.post({**PRICE, "effective_from": TS0}), 409)
    assert (err["code"], err["param"]) == ("price_exists", "effective_from")
    err = _error(api.post({**PRICE, "effective_from": TS0 + 1, "currency": "EUR"}), 409)
    assert (err["code"], err["param"]) == ("currency_mismatch", "currency")
    assert "prices are in USD" in err["message"]


def _record(api: Api, rid: str, at: datetime, deployment: str = "smollm2", **kw: Any) -> None:
    assert api.services.ledger.record(
        UsageRecord(rid, deployment, "chat.completions", "completed", created_at=at, **kw)
    )


def test_usage_carries_the_cost_of_each_group(api: Api) -> None:
    assert api.post({**PRICE, "effective_from": TS0}).status_code == 201
    # A price change on day 2: 1M tokens of each kind cost $1.000001 from then on.
    change = {"input": 1_000_001, "cached_input": 1_000_001, "output": 1_000_001}
    assert api.post({**change, "effective_from": TS0 + 86400}).status_code == 201
    _record(api, "a", T0 + timedelta(hours=1), prompt_tokens=1000, completion_tokens=100,
            cached_tokens=200)  # 800*0.15 + 200*0.075 + 100*0.6 = 195 micro-units # fmt: skip
    _record(api, "b", T0 + timedelta(days=1, hours=1), prompt_tokens=1_000_000,
            completion_tokens=0)  # 1000001 micro-units  # fmt: skip
    _record(api, "c", T0 - timedelta(hours=1), prompt_tokens=5, completion_tokens=5)  # no price

    params = {"start_time": TS0 - 86400, "end_time": TS0 + 2 * 86400, "group_by": "deployment"}
    body = api.client.get("/v1/usage", params=params, headers=api.h("usage")).json()
    results = [b["results"] for b in body["data"]]
    assert [[(r["cost"], r["cost_micros"]) for r in rs] for rs in results] == [
        [(None, None)],
        [({"value": "0.000195", "currency": "USD"}, 195)],
        [({"value": "1.000001", "currency": "USD"}, 1_000_001)],
    ]
    assert results[1][0]["model"] == "smollm2"
    # Another tenant sees none of it.
    body = api.client.get("/v1/usage", params=params, headers=api.h("acme")).json()
    assert [b["results"] for b in body["data"]] == [[], [], []]
