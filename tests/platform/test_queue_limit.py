"""A deployment's queue limit (``max_queue``): requests past it are 429s at once, with
``Retry-After``, while the ones already waiting for a replica keep their place (here until
their own wait runs out, as no worker ever registers), unless their client goes away."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from snapshot_folders import snapshot_folder
from starlette.testclient import TestClient
from uvicorn_thread import uvicorn_in_thread

from hotpool.billing.db import Database
from hotpool.platform.app import build_services, create_app
from hotpool.platform.services import Services
from hotpool.pool.backend import WorkerBackend, WorkerHandle
from hotpool.settings import load_settings

TOKEN = "queue-token"


class NeverRegisters(WorkerBackend):
    """Workers that start and never call back: a cold start that takes forever."""

    async def start(self, worker_id: str) -> WorkerHandle:
        return WorkerHandle(worker_id)

    async def stop(self, handle: WorkerHandle, grace_s: float = 10.0) -> None:
        pass

    def exit_reason(self, handle: WorkerHandle) -> str | None:
        return None


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[TestClient, Services]]:
    settings = load_settings({"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_WARM_WORKERS": "0"})
    db = Database(settings.database_url)
    db.upgrade()
    services = build_services(settings, db, NeverRegisters(), TOKEN)
    try:
        with TestClient(create_app(services)) as client:
            yield client, services
    finally:
        db.dispose()


def test_a_request_past_the_queue_limit_is_a_429_with_retry_after(
    app: tuple[TestClient, Services], tmp_path: Path
) -> None:
    client, services = app
    uri = f"file://{snapshot_folder(tmp_path / 'snap')}"
    spec = {"name": "tiny", "snapshot_uri": uri, "max_queue": 2, "queue_timeout_s": 2}
    assert client.post("/v1/deployments", json=spec).status_code == 201
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    waited: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda: waited.append(client.post("/v1/completions", json=body)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while services.router.queued("tiny") < 2:
        assert time.monotonic() < deadline, "the first two requests never queued"
        time.sleep(0.01)

    t0 = time.monotonic()
    over = client.post("/v1/completions", json=body)
    assert time.monotonic() - t0 < 1  # refused at once, not after a wait
    assert over.status_code == 429 and over.headers["retry-after"] == "5"
    error = over.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
    assert "max_queue" in error["message"]
    # Streaming asks the same way and is refused the same way, before any event.
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 429 and streamed.json()["error"]["code"] == "queue_full"

    for t in threads:
        t.join()
    # Those that were queued first kept their place until their own wait ran out.
    assert [r.status_code for r in waited] == [503, 503]
    assert {r.json()["error"]["code"] for r in waited} == {"queue_timeout"}
    assert services.router.queued("tiny") == 0
    assert client.post("/v1/completions", json=body).status_code == 503  # room again: it waits


@pytest.mark.parametrize(
    ("path", "extra"),
    [("/v1/completions", {}), ("/v1/completions", {"stream": True}),
     ("/v1/deployments/tiny/invoke", {})],
)  # fmt: skip
def test_a_client_that_gives_up_while_queued_leaves_the_queue_and_is_not_billed(
    tmp_path: Path, path: str, extra: dict[str, object]
) -> None:
    settings = load_settings({"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_WARM_WORKERS": "0"})
    db = Database(settings.database_url)
    db.upgrade()
    services = build_services(settings, db, NeverRegisters(), TOKEN)
    # A real server: a client's closed connection reaches the app as http.disconnect.
    with uvicorn_in_thread(create_app(services), lifespan="on") as url:
        uri = f"file://{snapshot_folder(tmp_path / 'snap')}"
        spec = {"name": "tiny", "snapshot_uri": uri, "max_queue": 1, "queue_timeout_s": 60}
        assert httpx.post(url + "/v1/deployments", json=spec).status_code == 201
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}
        if path.endswith("/invoke"):
            body = {"prompt": "hi", "params": {"max_tokens": 2}}
        for attempt in range(2):  # the second finds the place the first gave up
            with pytest.raises(httpx.ReadTimeout):  # queued (a 429 would be an answer)
                httpx.post(url + path, json=body, timeout=httpx.Timeout(5, read=0.5))
            deadline = time.monotonic() + 5
            while services.router.queued("tiny"):
                assert time.monotonic() < deadline, f"request {attempt} still holds the queue"
                time.sleep(0.02)
        deadline = time.monotonic() + 5
        while len(rows := services.ledger.events("tiny")) < 2:
            assert time.monotonic() < deadline, "the abandoned requests were never accounted"
            time.sleep(0.05)
    db.dispose()
    assert [(r.status, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        ("cancelled", 0, 0),
        ("cancelled", 0, 0),
    ]


def test_when_the_server_begins_to_stop_waiting_requests_get_a_503_at_once(
    waiting: Waiting,
) -> None:
    client, services, thread, waited = waiting.client, waiting.services, waiting.thread, waiting.got
    t0 = time.monotonic()
    assert client.portal is not None
    client.portal.call(services.begin_shutdown)  # what uvicorn's shutdown calls first
    thread.join(10)
    assert time.monotonic() - t0 < 5  # not after its 60 s wait, nor the 30 s drain
    [r] = waited
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "shutting_down"
    later = client.post("/v1/completions", json=waiting.body)  # one more on an open connection
    assert later.status_code == 503 and later.json()["error"]["code"] == "shutting_down"


def test_a_request_waiting_when_its_deployment_is_deleted_gets_a_404_at_once(
    waiting: Waiting,
) -> None:
    client, thread, waited = waiting.client, waiting.thread, waiting.got
    t0 = time.monotonic()
    assert client.delete("/v1/deployments/tiny").status_code == 200
    thread.join(10)
    assert time.monotonic() - t0 < 5  # not after its 60 s wait
    # Not a 503 "cold start failed", which the openai client would retry: the model is gone.
    [r] = waited
    assert r.status_code == 404 and r.json()["error"]["code"] == "deployment_not_found"
    assert "deleted" in r.json()["error"]["message"]
    # The name is free at once, and its new deployment starts from nothing of the old one.
    assert client.post("/v1/deployments", json=waiting.spec).status_code == 201
    assert client.get("/v1/deployments/tiny").json()["replicas"] == []


@dataclass
class Waiting:
    """A deployment whose replica never comes, and a request (sent from ``thread``) that
    waits for it; ``got`` holds its response once the thread ends."""

    client: TestClient
    services: Services
    spec: dict[str, object]
    body: dict[str, object]
    thread: threading.Thread
    got: list[httpx.Response]


@pytest.fixture
def waiting(app: tuple[TestClient, Services], tmp_path: Path) -> Iterator[Waiting]:
    client, services = app
    uri = f"file://{snapshot_folder(tmp_path / 'snap')}"
    spec: dict[str, object] = {"name": "tiny", "snapshot_uri": uri, "queue_timeout_s": 60}
    assert client.post("/v1/deployments", json=spec).status_code == 201
    body: dict[str, object] = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    got: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: got.append(client.post("/v1/completions", json=body)))
    thread.start()
    deadline = time.monotonic() + 5
    while services.router.queued("tiny") < 1:
        assert time.monotonic() < deadline, "the request never queued"
        time.sleep(0.01)
    yield Waiting(client, services, spec, body, thread, got)
    thread.join(70)
