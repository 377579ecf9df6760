"""The dashboard's own endpoints in process: the page and its files, ``/v1/me``, the
input checks of ``/v1/usage/summary`` and its speculation figures, kept after a deployment's
replicas are gone (the browser test covers what the page draws)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from instant_workers import InstantBackend
from snapshot_folders import snapshot_folder
from starlette.testclient import TestClient

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore
from hotpool.platform.app import build_services, create_app
from hotpool.platform.services import Services
from hotpool.pool.local import LocalProcessBackend, LocalWorkerConfig
from hotpool.pool.pool import WorkerPool
from hotpool.pool.replica import Replica, ReplicaState
from hotpool.settings import load_settings
from hotpool.worker.protocol import LoadResult

TOKEN = "t"


def _client(home: Path, auth: str) -> Iterator[tuple[TestClient, str]]:
    settings = load_settings(
        {"HOTPOOL_HOME": str(home), "HOTPOOL_WARM_WORKERS": "0", "HOTPOOL_AUTH": auth}
    )
    db = Database(settings.database_url)
    db.upgrade()
    backend = LocalProcessBackend(
        LocalWorkerConfig("http://127.0.0.1:9", TOKEN, settings.cache_dir, home / "logs")
    )
    _, key = KeyStore(db).create(1, "usage", name="laptop")
    try:
        with TestClient(create_app(build_services(settings, db, backend, TOKEN))) as client:
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


# --- speculation's figures outlive the replicas -------------------------------------------


def _worker_api(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/load":
        return httpx.Response(200, json=LoadResult("tiny", "sha", True).to_json())
    return httpx.Response(200, json={"status": "unloaded"})


@pytest.fixture
def pooled(tmp_path: Path) -> Iterator[tuple[TestClient, Services]]:
    """Local-only mode over stand-in workers; heartbeats arrive only when a test sends one."""
    settings = load_settings(
        {"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_WARM_WORKERS": "0", "HOTPOOL_AUTH": "none",
         "HOTPOOL_HEARTBEAT_TIMEOUT_S": "3600"}  # never reaped for a late beat of ours
    )  # fmt: skip
    db = Database(settings.database_url)
    db.upgrade()
    backend = InstantBackend()
    services = build_services(settings, db, backend, TOKEN)
    backend.registry = services.registry
    services.pool.launcher.client = httpx.AsyncClient(transport=httpx.MockTransport(_worker_api))
    try:
        with TestClient(create_app(services)) as client:
            yield client, services
    finally:
        db.dispose()


async def _ready_replica(pool: WorkerPool, services: Services, name: str) -> Replica:
    spec = services.catalog.get(name)
    assert spec is not None
    replica = pool.scale_up(spec)
    await asyncio.wait_for(replica.ready.wait(), 30)
    assert replica.state is ReplicaState.READY, replica.error
    return replica


def _heartbeat(client: TestClient, replica: Replica, proposed: int, accepted: int) -> None:
    """What the replica's worker sends: its engine's counts since the model loaded."""
    assert replica.worker is not None
    body = {**replica.worker.to_json(), "loaded": replica.deployment,
            "spec_proposed": proposed, "spec_accepted": accepted, "spec_enabled": True}  # fmt: skip
    r = client.post(
        f"/internal/workers/{replica.handle.worker_id}/heartbeat",
        json=body,
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 200, r.text


def _speculation(client: TestClient, name: str) -> tuple[dict[str, int], dict[str, Any]]:
    """The deployment's replicas by state and its speculation, as the summary reports them."""
    body = client.get("/v1/usage/summary").json()
    d = next(d for d in body["deployments"] if d["name"] == name)
    return d["replicas"], d["speculation"]


def _deploy(client: TestClient, home: Path, folder: str) -> None:
    snapshot = snapshot_folder(home / "objects" / "snapshots" / folder)
    spec = {"name": "tiny", "snapshot_uri": f"file://{snapshot}", "idle_timeout_s": 3600,
            "speculative": {"method": "ngram", "num_tokens": 3}}  # fmt: skip
    r = client.post("/v1/deployments", json=spec)
    assert r.status_code == 201, r.text


def test_the_acceptance_rate_outlives_the_replicas_that_reported_it(
    pooled: tuple[TestClient, Services], tmp_path: Path
) -> None:
    client, services = pooled
    pool = services.pool
    _deploy(client, tmp_path, "tiny")
    replica = client.portal.call(_ready_replica, pool, services, "tiny")
    _heartbeat(client, replica, 20, 10)
    _heartbeat(client, replica, 40, 30)  # counts since the model loaded: the last one holds
    replicas, spec = _speculation(client, "tiny")
    assert replicas["ready"] == 1
    assert (spec["proposed"], spec["accepted"], spec["acceptance_rate"]) == (40, 30, 0.75)
    assert (spec["replicas"], spec["enabled_replicas"]) == (1, 1)

    # Scaled to zero: no replica reports any more, and the rate its replica had stays.
    client.portal.call(pool.release, replica, "idle timeout")
    replicas, spec = _speculation(client, "tiny")
    assert sum(replicas.values()) == 0 and pool.replicas("tiny") == []
    assert (spec["proposed"], spec["accepted"], spec["acceptance_rate"]) == (40, 30, 0.75)
    assert (spec["method"], spec["num_tokens"], spec["replicas"]) == ("ngram", 3, 0)

    # The next replica's counts add to the gone one's.
    replica = client.portal.call(_ready_replica, pool, services, "tiny")
    _heartbeat(client, replica, 60, 15)
    _, spec = _speculation(client, "tiny")
    assert (spec["proposed"], spec["accepted"], spec["replicas"]) == (100, 45, 1)
    client.portal.call(pool.release, replica, "idle timeout")
    _, spec = _speculation(client, "tiny")
    assert (spec["proposed"], spec["accepted"], spec["replicas"]) == (100, 45, 0)


def test_a_new_deployment_of_a_deleted_ones_name_starts_with_no_figures(
    pooled: tuple[TestClient, Services], tmp_path: Path
) -> None:
    client, services = pooled
    _deploy(client, tmp_path, "first")
    replica = client.portal.call(_ready_replica, services.pool, services, "tiny")
    _heartbeat(client, replica, 40, 30)
    client.portal.call(services.pool.release, replica, "idle timeout")
    assert _speculation(client, "tiny")[1]["accepted"] == 30
    # Another tenant may take the name at once: the old deployment's figures are not its.
    assert client.delete("/v1/deployments/tiny").status_code == 200
    _deploy(client, tmp_path, "second")
    _, spec = _speculation(client, "tiny")
    assert (spec["proposed"], spec["accepted"], spec["acceptance_rate"]) == (0, 0, None)
