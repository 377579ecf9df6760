"""The dashboard's own endpoints in process: the page and its files, ``/v1/me`` and the
input checks of ``/v1/usage/summary`` (the browser test covers what the page draws)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore
from hotpool.platform.app import build_services, create_app
from hotpool.pool.local import LocalProcessBackend, LocalWorkerConfig
from hotpool.settings import load_settings


def _client(home: Path, auth: str) -> Iterator[tuple[TestClient, str]]:
    settings = load_settings(
        {"HOTPOOL_HOME": str(home), "HOTPOOL_WARM_WORKERS": "0", "HOTPOOL_AUTH": auth}
    )
    db = Database(settings.database_url)
    db.upgrade()
    backend = LocalProcessBackend(
        LocalWorkerConfig("http://127.0.0.1:9", "t", settings.cache_dir, home / "logs")
    )
    _, key = KeyStore(db).create(1, "usage", name="laptop")
    try:
        with TestClient(create_app(build_services(settings, db, backend, "t"))) as client:
            yield client, key
    finally:
        db.dispose()


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    yield from _client(tmp_path, "keys")


@pytest.fixture
def local(tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    yield from _client(tmp_path, "none")


def test_the_page_and_its_files_are_served_with_a_strict_policy(
    keyed: tuple[TestClient, str],
) -> None:
    client, _ = keyed
    r = client.get("/dashboard")  # no key: the page itself asks for one
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert 'id="sign-in-form"' in r.text
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css"),
                       ("chart.umd.min.js", "text/javascript")):  # fmt: skip
        asset = client.get(f"/dashboard/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert f"/dashboard/{name}" in r.text  # the page loads it from here, not the internet
    licence = client.get("/dashboard/chart.js-LICENSE.md")
    assert "MIT License" in licence.text
    assert "Chart.js v4" in client.get("/dashboard/chart.umd.min.js").text[:200]
    for bad in ("app.py", "..%2Fapp.py", "vendor", "index.html"):
        r = client.get(f"/dashboard/{bad}")
        assert r.status_code == 404, bad
        # A name outside the list, or a path that is no name at all (no route then).
        assert r.json()["error"]["message"].startswith(("no dashboard file named", "no route"))


def test_me_names_the_tenant_and_scopes_of_a_key(keyed: tuple[TestClient, str]) -> None:
    client, key = keyed
    r = client.get("/v1/me", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200
    me = r.json()
    assert me["auth"] == "keys" and me["admin"] is False and me["operator"] is False
    assert me["tenant"] == {"id": 1, "name": "default"}
    assert me["key"]["scopes"] == ["usage"] and me["key"]["name"] == "laptop"
    assert key.startswith(me["key"]["prefix"]) and key not in r.text
    r = client.get("/v1/me", headers={"authorization": "Bearer hp_wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_me_in_local_mode_says_auth_is_off(local: tuple[TestClient, str]) -> None:
    client, _ = local
    me = client.get("/v1/me").json()
    assert (me["auth"], me["key"], me["admin"], me["operator"]) == ("off", None, True, True)


@pytest.mark.parametrize(
    ("params", "param", "message"),
    [
        ({"start_time": "10", "end_time": "10"}, "start_time", "before `end_time`"),
        ({"start_time": "0", "end_time": str(400 * 86400)}, "start_time", "at most 366 days"),
        ({"start_time": "soon"}, "start_time", "must be an integer"),
        ({"end_time": "-5"}, "end_time", "Unix time"),
        ({"bucket_width": "1h"}, "bucket_width", "unknown query parameter"),
    ],
)
def test_summary_refuses_bad_ranges_with_the_parameter_named(
    local: tuple[TestClient, str], params: dict[str, str], param: str, message: str
) -> None:
    client, _ = local
    r = client.get("/v1/usage/summary", params=params)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_the_default_summary_range_starts_no_earlier_than_1970(
    local: tuple[TestClient, str],
) -> None:
    client, _ = local
    body = client.get("/v1/usage/summary", params={"end_time": "1"}).json()
    assert (body["start_time"], body["end_time"]) == (0, 1)


def test_summary_of_an_empty_ledger_lists_nothing(local: tuple[TestClient, str]) -> None:
    client, _ = local
    body = client.get("/v1/usage/summary").json()
    assert body["requests"] == {"completed": 0, "partial": 0, "error": 0, "cancelled": 0}
    assert (body["deployments"], body["scale_events"]) == ([], [])
    assert body["end_time"] - body["start_time"] == 24 * 3600  # the default range
