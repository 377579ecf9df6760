"""``GET /v1/deployments/{name}/capacity`` over stand-in workers (tests/platform/
test_dashboard_api.py's): each ready replica's curve as its worker's heartbeat reported it,
and the device that worker runs on, which ``hotpool plan`` names its devices by."""

from __future__ import annotations

from pathlib import Path

from starlette.testclient import TestClient
from test_dashboard_api import TOKEN, _deploy, _ready_replica, pooled  # noqa: F401 (a fixture)

from hotpool.platform.services import Services


def test_each_replica_says_its_curve_and_the_device_its_worker_reported(
    pooled: tuple[TestClient, Services],  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    client, services = pooled
    _deploy(client, tmp_path, "tiny")
    replica = client.portal.call(_ready_replica, services.pool, services, "tiny")
    assert replica.worker is not None and replica.worker.device == "cpu"
    beat = {**replica.worker.to_json(), "loaded": "tiny", "capacity": {"1": 9.0, "30": 150.0}}
    r = client.post(
        f"/internal/workers/{replica.handle.worker_id}/heartbeat",
        json=beat,
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 200, r.text
    body = client.get("/v1/deployments/tiny/capacity").json()
    (one,) = body["replicas"]
    assert one["device"] == "cpu" and body["measured_replicas"] == 1
    assert (
        [p["step_tokens"] for p in one["curve"]]
        == [1, 30]
        == [p["step_tokens"] for p in body["curve"]]
    )
