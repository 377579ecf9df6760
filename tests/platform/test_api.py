"""The control plane's public HTTP API as a client sees it: the real Starlette app, a real
SQLite ledger, a real local-process backend (no request here ever reaches a worker)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from snapshot_folders import snapshot_folder
from starlette.requests import Request
from starlette.testclient import TestClient

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.prices import PriceStore
from hotpool.billing.scale_events import ScaleEventRecord
from hotpool.cli_common import snapshot_uri
from hotpool.platform.app import build_services, create_app
from hotpool.platform.errors import APIError
from hotpool.platform.services import Services, read_body
from hotpool.pool.local import LocalProcessBackend, LocalWorkerConfig
from hotpool.settings import load_settings
from hotpool.worker.snapshot.manifest import build_manifest, read_manifest, write_manifest

TOKEN = "test-worker-token"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    settings = load_settings({"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_WARM_WORKERS": "0"})
    db = Database(settings.database_url)
    db.upgrade()
    backend = LocalProcessBackend(
        LocalWorkerConfig(
            control_plane_url="http://127.0.0.1:9",
            token=TOKEN,
            cache_dir=settings.cache_dir,
            log_dir=tmp_path / "logs",
        )
    )
    try:
        yield build_services(settings, db, backend, TOKEN)
    finally:
        db.dispose()


@pytest.fixture
def client(services: Services) -> Iterator[TestClient]:
    with TestClient(create_app(services)) as c:
        yield c


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """A folder the API accepts as a snapshot: a manifest for a model type workers run."""
    return snapshot_folder(tmp_path / "objects" / "snapshots" / "tiny")


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI-shaped error of a response, after checking its status."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


# --- basics -------------------------------------------------------------------------------


def test_healthz(client: TestClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_every_response_carries_a_fresh_request_id(client: TestClient) -> None:
    responses = [
        client.get("/healthz"),
        client.get("/healthz"),
        client.get("/nowhere"),
        client.post("/v1/chat/completions", content=b"{"),
        client.get("/metrics"),
    ]
    ids = [r.headers.get("x-request-id") for r in responses]
    assert all(i and i.startswith("req_") for i in ids), ids
    assert len(set(ids)) == len(ids)


def test_a_clients_request_id_is_echoed_but_never_the_ledger_key(client: TestClient) -> None:
    r = client.get("/healthz", headers={"x-request-id": "trace-42:abc"})
    assert r.headers.get_list("x-request-id") == ["trace-42:abc"]
    key = r.headers["x-hotpool-request-id"]
    assert key.startswith("req_") and key != "trace-42:abc"
    for bad in ("has space", "x" * 65, "", "-leading", "semi;colon"):
        r = client.get("/healthz", headers={"x-request-id": bad})
        assert r.headers["x-request-id"] == r.headers["x-hotpool-request-id"]  # ignored


def test_each_request_is_in_the_access_log_once_over_but_not_worker_heartbeats(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="hotpool.access"):
        ok = client.get("/healthz?probe=1")
        missing = client.get("/v1/nothing-here")
        client.post("/internal/workers/w-unknown/heartbeat", json={})
    lines = [r for r in caplog.records if r.name == "hotpool.access"]
    assert [(r.method, r.path, r.status) for r in lines] == [  # type: ignore[attr-defined]
        ("GET", "/healthz", 200),
        ("GET", "/v1/nothing-here", 404),
    ]
    assert lines[0].request_id == ok.headers["x-hotpool-request-id"]  # type: ignore[attr-defined]
    assert lines[1].request_id == missing.headers["x-hotpool-request-id"]  # type: ignore[attr-defined]
    assert '"GET /healthz?probe=1 HTTP/1.1" 200' in lines[0].getMessage()
    assert all(r.duration_ms >= 0 for r in lines)  # type: ignore[attr-defined]


def test_a_path_cannot_forge_a_line_of_the_access_log(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="hotpool.access"):
        client.get("/v1/keys/%0a2026-12-01 FAKE ERROR injected%00%ff")
    [line] = [r.getMessage() for r in caplog.records if r.name == "hotpool.access"]
    assert "\n" not in line and "\x00" not in line  # one line, and no NUL in the log
    assert "%0A2026-12-01%20FAKE%20ERROR%20injected%00" in line


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
def test_asking_for_prompts_in_the_log_is_loud_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, level: int
) -> None:
    env = {"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_WARM_WORKERS": "0"}
    settings = load_settings({**env, "HOTPOOL_LOG_PROMPTS": "500"})
    db = Database(settings.database_url)
    db.upgrade()
    config = LocalWorkerConfig("http://127.0.0.1:9", TOKEN, settings.cache_dir, tmp_path / "l")
    services = build_services(settings, db, LocalProcessBackend(config), TOKEN)
    try:
        with caplog.at_level(level), TestClient(create_app(services)):
            pass
    finally:
        db.dispose()
    said = [r.getMessage() for r in caplog.records if "HOTPOOL_LOG_PROMPTS=500" in r.getMessage()]
    levels = {r.levelno for r in caplog.records if "HOTPOOL_LOG_PROMPTS=500" in r.getMessage()}
    assert len(said) == 1 and levels == {logging.WARNING}
    if level == logging.DEBUG:
        assert said[0].startswith("PROMPTS ARE LOGGED") and "500 characters" in said[0]
    else:
        assert "has no effect" in said[0] and "HOTPOOL_LOG_LEVEL=debug" in said[0]


def test_unknown_route_is_an_openai_404(client: TestClient) -> None:
    err = error_of(client.get("/v1/nothing-here"), 404)
    assert err["type"] == "invalid_request_error"
    assert "/v1/nothing-here" in err["message"]


def test_wrong_method_is_an_openai_405(client: TestClient) -> None:
    r = client.get("/v1/chat/completions")
    assert "GET" in error_of(r, 405)["message"]
    assert r.headers["allow"] == "POST"  # HTTP requires it on a 405
    r = client.delete("/healthz")
    error_of(r, 405)
    assert r.headers["allow"] == "GET, HEAD"
    r = client.put("/v1/deployments")  # GET and POST are two routes: both are allowed
    error_of(r, 405)
    assert r.headers["allow"] == "GET, HEAD, POST"


def test_an_invocation_path_with_a_trailing_slash_is_redirected_as_any_route(
    client: TestClient,
) -> None:
    r = client.post("/v1/completions/", json={}, follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"].endswith("/v1/completions")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/deployments"])
def test_invalid_and_empty_json_bodies_are_400(client: TestClient, path: str) -> None:
    err = error_of(client.post(path, content=b'{"model": '), 400)
    assert "not valid JSON" in err["message"]
    err = error_of(client.post(path, content=b""), 400)
    assert "empty" in err["message"]
    err = error_of(client.post(path, content=b"\xff\xfe"), 400)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", '{"model": "\\ud800", "messages": []}', "model"),
        ("/v1/chat/completions", '{"model": "m", "\\udfff": 1}', None),
        ("/v1/chat/completions",
         '{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
         "messages[0].content"),
        ("/v1/chat/completions",
         '{"model": "m", "messages": [{"role": "user", "content": "x", "\\udc00": 1}]}',
         "messages[0]"),
        ("/v1/chat/completions", '{"model": "m", "messages": [], "user": "\\uDBFF"}', "user"),
        ("/v1/completions", '{"model": "m", "prompt": ["ok", "\\ude00\\ud83d"]}', "prompt[1]"),
        ("/v1/deployments/tiny/invoke", '{"prompt": "x", "params": {"\\ud800": 1}}', "params"),
        ("/v1/deployments", '{"name": "x", "snapshot_uri": "s3://bucket/p\\ud800"}',
         "snapshot_uri"),
        ("/v1/deployments", '{"name": "x", "snapshot_uri": "file:///tmp/\\ud800"}',
         "snapshot_uri"),
        ("/v1/keys", '{"tenant": "t", "name": "\\ud800"}', "name"),
    ],
)  # fmt: skip
def test_an_unpaired_surrogate_escape_anywhere_is_a_400_naming_where(
    client: TestClient, path: str, body: str, param: str | None
) -> None:
    # Python's json module decodes "\ud800" alone to a string no encoder takes: echoed in an
    # error message, stored or tokenized, it was a 500 (or a 502 from the worker).
    err = error_of(client.post(path, content=body.encode()), 400)
    assert err["param"] == param
    assert "unpaired UTF-16 surrogate" in err["message"]
    # A pair is one character (U+1F600 here), and fine: these get past that check.
    paired = body.replace("\\ud800", "\\ud83d\\ude00").replace("\\udfff", "\\ud83d\\ude00")
    paired = paired.replace("\\udc00", "\\ud83d\\ude00").replace("\\uDBFF", "\\ud83d\\ude00")
    paired = paired.replace('"\\ude00\\ud83d"', '"\\ud83d\\ude00"')
    r = client.post(path, content=paired.encode())
    assert r.status_code < 500 and "surrogate" not in r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/keys"])
def test_a_body_must_be_utf_8(client: TestClient, path: str) -> None:
    # json.loads(bytes) also takes UTF-16 and CESU-style surrogate bytes: neither is UTF-8
    for body in (b'{"name": "\xed\xa0\x80", "tenant": "t"}', '{"name": "x"}'.encode("utf-16")):
        err = error_of(client.post(path, content=body), 400)
        assert "not valid JSON" in err["message"] and "utf-8" in err["message"]


def test_a_chunked_body_over_the_limit_is_refused_before_it_is_all_read() -> None:
    """A chunked upload has no length to check first: it is counted as it comes, and 413
    once past the limit, not held whole in memory (64 MiB sent here; ~9 MiB read)."""
    pulled = 0

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b" " * (1 << 20), "more_body": pulled < 64}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(APIError) as err:
        asyncio.run(read_body(request))
    assert err.value.status == 413 and pulled == 9

    declared = Request({"type": "http", "headers": [(b"content-length", b"9999999999")]}, receive)
    pulled = 0
    with pytest.raises(APIError):  # a declared length over it: not a byte is read
        asyncio.run(read_body(declared))
    assert pulled == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/deployments", "/v1/keys"])
def test_a_body_over_the_limit_is_413(client: TestClient, path: str) -> None:
    err = error_of(client.post(path, content=b"{" + b" " * (8 * 1024 * 1024)), 413)
    assert "larger than" in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [({"max_tokens": -1}, "max_tokens"), ({"max_tokens": "ten"}, "max_tokens"),
     ({"temperature": 3}, "temperature"), ({"messages": "hi"}, "messages"),
     ({"model": 7}, "model"), ({"stream": "yes"}, "stream")],
)  # fmt: skip
def test_wrong_types_and_ranges_are_400_naming_the_param(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    full = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    err = error_of(client.post("/v1/chat/completions", json=full), 400)
    assert err["param"] == param


def test_validation_errors_reach_the_client_with_their_param(client: TestClient) -> None:
    err = error_of(client.post("/v1/chat/completions", json={"model": "m", "messages": []}), 400)
    assert err["param"] == "messages"
    err = error_of(client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": 0}), 400)
    assert err["param"] == "n"


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "ghost", "messages": HI}),
        ("/v1/completions", {"model": "ghost", "prompt": "hi"}),
    ],
)
def test_unknown_model_is_model_not_found(client: TestClient, path: str, body: Any) -> None:
    err = error_of(client.post(path, json=body), 404)
    assert err["code"] == "model_not_found"
    assert err["param"] == "model"
    assert "ghost" in err["message"]
    err = error_of(client.get("/v1/models/ghost"), 404)
    assert err["code"] == "model_not_found"


# --- deployments ----------------------------------------------------------------------------


def deploy(client: TestClient, snapshot: Path, **fields: Any) -> httpx.Response:
    return client.post(
        "/v1/deployments", json={"name": "tiny", "snapshot_uri": f"file://{snapshot}", **fields}
    )


def test_create_deployment_shows_everywhere(client: TestClient, snapshot: Path) -> None:
    assert client.get("/v1/deployments").json() == {"object": "list", "data": []}
    assert client.get("/v1/models").json() == {"object": "list", "data": []}

    r = deploy(
        client, snapshot, max_replicas=3, target_concurrency=4, idle_timeout_s=60,
        default_max_tokens=256, max_tokens_limit=2048,
    )  # fmt: skip
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["object"] == "deployment"
    assert created["name"] == "tiny"
    assert created["snapshot_uri"] == f"file://{snapshot}"
    assert created["scaling"] == {
        "min_replicas": 0,
        "max_replicas": 3,
        "target_concurrency": 4,
        "idle_timeout_s": 60.0,
        "max_queue": 256,  # the server's defaults until the deployment sets its own
        "queue_timeout_s": 300.0,
    }
    assert created["engine"] == {
        "dtype": None,
        "quantization": "none",
        "speculative": None,
        "max_model_len": None,
        "kv_cache_bytes": 1 << 30,
    }
    answers = {"default_max_tokens": 256, "max_tokens_limit": 2048}
    assert created["answers"] == answers
    assert created["generation"] == 1 and created["last_cold_start"] is None
    assert created["replicas"] == []  # scaled to zero: no GPU held until the first request
    assert created["queued_requests"] == 0
    assert isinstance(created["created_at"], int)

    assert client.get("/v1/deployments/tiny").json() == created
    assert client.get("/v1/deployments").json()["data"] == [created]
    models = client.get("/v1/models").json()["data"]
    assert models == [
        {
            "id": "tiny",
            "object": "model",
            "created": created["created_at"],
            "owned_by": "hotpool",
            "answers": answers,  # what a client may ask for, without the deployments API
        }
    ]
    assert client.get("/v1/models/tiny").json() == models[0]


def test_deployment_defaults(client: TestClient, services: Services, snapshot: Path) -> None:
    r = client.post("/v1/deployments", json={"name": "d", "snapshot_uri": f"file://{snapshot}/"})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["snapshot_uri"] == f"file://{snapshot}"  # trailing slash dropped
    assert body["scaling"] == {
        "min_replicas": 0,
        "max_replicas": 1,
        "target_concurrency": 8,
        "idle_timeout_s": services.settings.default_idle_timeout_s,
        "max_queue": services.settings.max_queue,
        "queue_timeout_s": services.settings.queue_timeout_s,
    }


def test_deployment_survives_a_restart(services: Services, snapshot: Path, tmp_path: Path) -> None:
    with TestClient(create_app(services)) as c:
        assert deploy(c, snapshot).status_code == 201
    settings = services.settings
    db = Database(settings.database_url)
    backend = LocalProcessBackend(
        LocalWorkerConfig("http://127.0.0.1:9", TOKEN, settings.cache_dir, tmp_path / "logs")
    )
    try:
        with TestClient(create_app(build_services(settings, db, backend, TOKEN))) as c:
            assert [d["name"] for d in c.get("/v1/deployments").json()["data"]] == ["tiny"]
    finally:
        db.dispose()


def test_duplicate_deployment_is_409(client: TestClient, snapshot: Path) -> None:
    assert deploy(client, snapshot).status_code == 201
    err = error_of(deploy(client, snapshot, max_replicas=2), 409)
    assert err["code"] == "deployment_exists"
    assert err["param"] == "name"
    # The first one is untouched.
    assert client.get("/v1/deployments/tiny").json()["scaling"]["max_replicas"] == 1


@pytest.mark.parametrize(
    "name", ["", "Upper", "-starts-with-dash", ".dot", "has space", "a/b", "x" * 64, 7, None]
)
def test_bad_deployment_name_is_400(client: TestClient, snapshot: Path, name: Any) -> None:
    err = error_of(deploy(client, snapshot, name=name), 400)
    assert err["param"] == "name"


def test_longest_valid_name_is_accepted(client: TestClient, snapshot: Path) -> None:
    assert deploy(client, snapshot, name="a" * 63).status_code == 201


@pytest.mark.parametrize(
    "uri", [None, "", "relative/path", "/abs/without/scheme", "http://host/x", "file://rel", 5]
)
def test_bad_snapshot_uri_is_400(client: TestClient, uri: Any) -> None:
    err = error_of(client.post("/v1/deployments", json={"name": "d", "snapshot_uri": uri}), 400)
    assert err["param"] == "snapshot_uri"


def test_a_bare_snapshot_name_is_the_local_stores_on_create_and_patch(
    client: TestClient, services: Services, snapshot: Path, tmp_path: Path
) -> None:
    # `snapshot` is <HOTPOOL_HOME>/objects/snapshots/tiny, where `hotpool snapshot push SRC
    # tiny` puts it (and `hotpool models pull` its models): the CLI's `tiny`.
    cli_uri = snapshot_uri(services.settings, "tiny")
    assert cli_uri == f"file://{snapshot}"
    r = client.post("/v1/deployments", json={"name": "named", "snapshot_uri": "tiny"})
    assert r.status_code == 201, r.text
    assert r.json()["snapshot_uri"] == cli_uri  # stored resolved: what the workers fetch
    assert client.get("/v1/deployments/named").json()["snapshot_uri"] == cli_uri

    v2 = snapshot_folder(tmp_path / "objects" / "snapshots" / "org" / "tiny-v2")
    r = client.patch("/v1/deployments/named", json={"snapshot_uri": "org/tiny-v2"})
    assert r.status_code == 200, r.text
    assert (
        r.json()["snapshot_uri"] == f"file://{v2}" == snapshot_uri(services.settings, "org/tiny-v2")
    )
    assert r.json()["version"] == 2
    # The same name again is the same URI: nothing changes, no new version.
    r = client.patch(
        "/v1/deployments/named", json={"snapshot_uri": "org/tiny-v2", "max_replicas": 2}
    )
    assert r.status_code == 200 and r.json()["version"] == 2, r.text
    versions = client.get("/v1/deployments/named/versions").json()["data"]
    assert [v["snapshot_uri"] for v in versions] == [cli_uri, f"file://{v2}"]


def test_a_name_not_in_the_local_store_is_400_naming_the_store(
    client: TestClient, services: Services, snapshot: Path
) -> None:
    store = f"file://{services.settings.snapshots_dir}"
    err = error_of(
        client.post("/v1/deployments", json={"name": "d", "snapshot_uri": "smollm2-fp32"}), 400
    )
    assert err["param"] == "snapshot_uri" and err["code"] == "snapshot_not_found"
    assert "'smollm2-fp32'" in err["message"] and store in err["message"]
    assert client.get("/v1/deployments").json()["data"] == []  # nothing was created

    assert deploy(client, snapshot).status_code == 201
    err = error_of(client.patch("/v1/deployments/tiny", json={"snapshot_uri": "gone/v3"}), 400)
    assert err["code"] == "snapshot_not_found" and store in err["message"]
    current = client.get("/v1/deployments/tiny").json()
    assert current["snapshot_uri"] == f"file://{snapshot}" and current["version"] == 1
    # A folder without a manifest is no snapshot either.
    (services.settings.snapshots_dir / "half-pushed").mkdir()
    err = error_of(
        client.post("/v1/deployments", json={"name": "d", "snapshot_uri": "half-pushed"}), 400
    )
    assert err["code"] == "snapshot_not_found"
    # A name too long for the file system is not there either (not a 500), and cut short.
    r = client.post("/v1/deployments", json={"name": "d", "snapshot_uri": "n" * 5000})
    err = error_of(r, 400)
    assert err["code"] == "snapshot_not_found" and len(err["message"]) < 700


@pytest.mark.parametrize("value", ["../escape", "a/../../b", "with space", "tiny/", "/x" * 3000])
def test_a_value_neither_name_nor_uri_is_400_as_in_the_cli(
    client: TestClient, snapshot: Path, value: str
) -> None:
    assert deploy(client, snapshot).status_code == 201
    for r in (
        client.post("/v1/deployments", json={"name": "d", "snapshot_uri": value}),
        client.patch("/v1/deployments/tiny", json={"snapshot_uri": value}),
    ):
        err = error_of(r, 400)
        assert err["param"] == "snapshot_uri" and "is neither a snapshot name" in err["message"]
        assert len(err["message"]) < 500  # a long value is cut short


def test_missing_snapshot_is_422(client: TestClient, tmp_path: Path) -> None:
    err = error_of(deploy(client, tmp_path / "nowhere"), 422)
    assert err["param"] == "snapshot_uri"
    assert "manifest.json" in err["message"]
    empty = tmp_path / "empty-snapshot"
    empty.mkdir()
    error_of(deploy(client, empty), 422)
    broken = tmp_path / "broken-snapshot"
    broken.mkdir()
    (broken / "manifest.json").write_text("{}")
    assert "manifest" in error_of(deploy(client, broken), 422)["message"]


def test_a_path_the_file_system_cannot_take_is_422_not_500(client: TestClient) -> None:
    for path in ("/" + "a" * 300, "/" + "/".join(["b" * 255] * 20), "/x\x00y"):
        r = client.post("/v1/deployments", json={"name": "long", "snapshot_uri": f"file://{path}"})
        err = error_of(r, 422)
        assert err["param"] == "snapshot_uri" and len(err["message"]) < 300


def test_a_model_type_workers_cannot_run_is_422(client: TestClient, tmp_path: Path) -> None:
    err = error_of(deploy(client, snapshot_folder(tmp_path / "gpt2", model_type="gpt2")), 422)
    assert err["param"] == "snapshot_uri"
    assert "'gpt2'" in err["message"] and "llama" in err["message"]
    assert client.get("/v1/deployments").json()["data"] == []  # nothing was created
    assert client.get("/v1/deployments").json()["data"] == []


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"min_replicas": 2, "max_replicas": 1}, "min_replicas"),
        ({"min_replicas": -1}, "min_replicas"),
        ({"max_replicas": 0}, "max_replicas"),
        ({"max_replicas": 1.5}, "max_replicas"),
        ({"max_replicas": True}, "max_replicas"),
        ({"target_concurrency": 0}, "target_concurrency"),
        ({"idle_timeout_s": 0}, "idle_timeout_s"),
        ({"idle_timeout_s": -5}, "idle_timeout_s"),
        ({"idle_timeout_s": "60"}, "idle_timeout_s"),
        ({"idle_timeout_s": 8 * 86400}, "idle_timeout_s"),
        ({"gpu": "h100"}, "gpu"),
        ({"max_queue": 0}, "max_queue"),
        ({"queue_timeout_s": 0}, "queue_timeout_s"),
        ({"queue_timeout_s": 1e9}, "queue_timeout_s"),
        ({"dtype": "int4"}, "dtype"),
        ({"quantization": "int4"}, "quantization"),
        ({"quantization": "INT8"}, "quantization"),
        ({"quantization": 8}, "quantization"),
        ({"quantization": ["gguf"]}, "quantization"),
        ({"speculative": "ngram"}, "speculative"),
        ({"speculative": {"method": "eagle"}}, "speculative"),
        ({"speculative": {"num_tokens": 0}}, "speculative"),
        ({"speculative": {"num_tokens": 17}}, "speculative"),
        ({"speculative": {"num_tokens": 2.5}}, "speculative"),
        ({"speculative": {"max_batch": -1}}, "speculative"),
        ({"speculative": {"ngram": {"min_n": 3, "max_n": 2}}}, "speculative"),
        ({"speculative": {"ngram": {"n": 3}}}, "speculative"),
        ({"speculative": {"k": 3}}, "speculative"),
        ({"speculative": {"method": "draft"}}, "speculative"),
        ({"speculative": {"draft_snapshot": "s3://bucket/d"}}, "speculative"),
        (
            {"speculative": {"method": "draft", "draft_snapshot": "nope"}},
            "speculative.draft_snapshot",
        ),
        (
            {"speculative": {"method": "draft", "draft_snapshot": "http://x/y"}},
            "speculative.draft_snapshot",
        ),
        ({"max_model_len": 8}, "max_model_len"),
        ({"kv_cache_bytes": 1024}, "kv_cache_bytes"),
        ({"kv_cache_bytes": (1 << 44) + 1}, "kv_cache_bytes"),  # more than any machine holds
        ({"kv_cache_bytes": (1 << 63) - 1}, "kv_cache_bytes"),
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
        ({"default_max_tokens": 0}, "default_max_tokens"),
        ({"max_tokens_limit": "many"}, "max_tokens_limit"),
        ({"default_max_tokens": 600, "max_tokens_limit": 500}, "default_max_tokens"),
    ],
)
def test_bad_scaling_is_400(
    client: TestClient, snapshot: Path, fields: dict[str, Any], param: str
) -> None:
    err = error_of(deploy(client, snapshot, **fields), 400)
    assert err["param"] == param


def test_deployment_body_must_be_an_object(client: TestClient) -> None:
    error_of(client.post("/v1/deployments", json=["tiny"]), 400)


def test_unknown_deployment_is_404(client: TestClient) -> None:
    err = error_of(client.get("/v1/deployments/ghost"), 404)
    assert err["code"] == "deployment_not_found"


def test_scale_events_page_newest_first(
    client: TestClient, services: Services, snapshot: Path
) -> None:
    spec = {"name": "scaled", "snapshot_uri": f"file://{snapshot}"}
    assert client.post("/v1/deployments", json=spec).status_code == 201
    store = services.scale_events.store
    tenant = services.catalog.tenant_of("scaled")
    for i in range(3):
        store.record(ScaleEventRecord("scaled", i, i + 1, f"load {i}", tenant_id=tenant))
    store.record(ScaleEventRecord("other", 0, 1, "request", tenant_id=tenant))
    page = client.get("/v1/deployments/scaled/events", params={"limit": 2}).json()
    assert [e["reason"] for e in page["data"]] == ["load 2", "load 1"]
    assert page["has_more"] is True
    assert set(page["data"][0]) >= {"from_replicas", "to_replicas", "cold_start_seconds"}
    rest = client.get(
        "/v1/deployments/scaled/events", params={"before": page["next_before"]}
    ).json()
    assert [e["reason"] for e in rest["data"]] == ["load 0"] and rest["has_more"] is False


@pytest.mark.parametrize(
    ("params", "param"),
    [({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"limit": "1001"}, "limit"),
     ({"before": "-1"}, "before"), ({"limit": "1_0"}, "limit"), ({"limit": " 1"}, "limit"),
     ({"limit": "+5"}, "limit"), ({"limit": "٣"}, "limit")],
)  # fmt: skip
def test_bad_scale_event_query_is_400(
    client: TestClient, snapshot: Path, params: dict[str, str], param: str
) -> None:
    spec = {"name": "scaled", "snapshot_uri": f"file://{snapshot}"}
    assert client.post("/v1/deployments", json=spec).status_code == 201
    err = error_of(client.get("/v1/deployments/scaled/events", params=params), 400)
    assert err["param"] == param


def test_scale_events_of_unknown_deployment_is_404(client: TestClient) -> None:
    err = error_of(client.get("/v1/deployments/ghost/events"), 404)
    assert err["code"] == "deployment_not_found"


def test_patch_changes_settings_and_bumps_the_generation_only_for_what_replicas_run(
    client: TestClient, snapshot: Path
) -> None:
    assert deploy(client, snapshot).status_code == 201
    r = client.patch("/v1/deployments/tiny", json={"max_replicas": 4, "max_queue": 9})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["scaling"]["max_replicas"] == 4 and body["scaling"]["max_queue"] == 9
    assert body["generation"] == 1  # scaling only: the same replicas go on serving
    r = client.patch("/v1/deployments/tiny", json={"dtype": "fp32", "max_model_len": 512})
    assert r.json()["generation"] == 2 and r.json()["engine"]["dtype"] == "fp32"
    r = client.patch("/v1/deployments/tiny", json={"max_queue": None})  # back to the default
    assert r.json()["scaling"]["max_queue"] == 256
    assert client.get("/v1/deployments/tiny").json() == r.json()


def test_quantization_is_an_engine_option_each_change_a_new_version(
    client: TestClient, snapshot: Path
) -> None:
    r = deploy(client, snapshot, quantization="int8")
    assert r.status_code == 201, r.text
    assert r.json()["engine"]["quantization"] == "int8"
    r = client.patch("/v1/deployments/tiny", json={"max_replicas": 2})
    assert (r.json()["version"], r.json()["engine"]["quantization"]) == (1, "int8")
    r = client.patch("/v1/deployments/tiny", json={"quantization": None})  # back to the default
    assert r.status_code == 200, r.text
    assert (r.json()["version"], r.json()["engine"]["quantization"]) == (2, "none")
    r = client.patch("/v1/deployments/tiny", json={"quantization": "none"})  # the same: no-op
    assert r.json()["version"] == 2
    versions = client.get("/v1/deployments/tiny/versions").json()["data"]
    assert [v["engine"]["quantization"] for v in versions] == ["int8", "none"]
    assert versions[1]["changes"] == {"quantization": ["int8", "none"]}
    err = error_of(client.patch("/v1/deployments/tiny", json={"quantization": "fp8"}), 400)
    assert err["param"] == "quantization" and "none, int8, gguf" in err["message"]


def test_speculative_is_an_engine_option_stored_with_its_defaults(
    client: TestClient, snapshot: Path
) -> None:
    r = deploy(client, snapshot, speculative={"method": "ngram", "num_tokens": 3})
    assert r.status_code == 201, r.text
    stored = {"method": "ngram", "num_tokens": 3, "max_batch": 4,
              "ngram": {"min_n": 1, "max_n": 4}}  # fmt: skip
    assert r.json()["engine"]["speculative"] == stored
    # The same policy written differently is no change; another k is a new version.
    r = client.patch("/v1/deployments/tiny", json={"speculative": {"num_tokens": 3}})
    assert r.json()["version"] == 1
    r = client.patch("/v1/deployments/tiny", json={"speculative": {"num_tokens": 6}})
    assert (r.json()["version"], r.json()["engine"]["speculative"]["num_tokens"]) == (2, 6)
    r = client.patch("/v1/deployments/tiny", json={"speculative": None})  # off
    assert (r.json()["version"], r.json()["engine"]["speculative"]) == (3, None)
    versions = client.get("/v1/deployments/tiny/versions").json()["data"]
    assert [v["engine"]["speculative"] and v["engine"]["speculative"]["num_tokens"]
            for v in versions] == [3, 6, None]  # fmt: skip
    err = error_of(client.patch("/v1/deployments/tiny", json={"speculative": {"k": 2}}), 400)
    assert err["param"] == "speculative" and "num_tokens" in err["message"]


def test_a_draft_model_resolves_by_name_in_the_local_store(
    client: TestClient, snapshot: Path
) -> None:
    # A local draft is checked now, as snapshot_uri is; the stored policy holds its URI.
    draft = {"method": "draft", "draft_snapshot": f"file://{snapshot}/"}
    r = deploy(client, snapshot, speculative=draft)
    assert r.status_code == 201, r.text
    assert r.json()["engine"]["speculative"]["draft_snapshot"] == f"file://{snapshot}"
    missing = {"method": "draft", "draft_snapshot": f"file://{snapshot}-missing"}
    r = client.patch("/v1/deployments/tiny", json={"speculative": missing})
    err = error_of(r, 422)
    assert err["param"] == "speculative.draft_snapshot"


def _with_gguf_blocks(folder: Path, quantized: Any) -> Path:
    """``folder``'s manifest with a ``quantized`` list, as a GGUF converted keeping its
    blocks writes it."""
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "quantized": quantized}))
    return folder


def test_gguf_quantization_needs_a_snapshot_that_keeps_gguf_blocks(
    client: TestClient, snapshot: Path, tmp_path: Path
) -> None:
    err = error_of(deploy(client, snapshot, quantization="gguf"), 400)
    assert err["param"] == "quantization"
    assert f"file://{snapshot}" in err["message"] and "keeps no GGUF blocks" in err["message"]
    assert "int8" in err["message"]  # what to do instead
    assert client.get("/v1/deployments").json()["data"] == []  # nothing was created
    empty = _with_gguf_blocks(snapshot_folder(tmp_path / "empty"), [])
    error_of(deploy(client, empty, quantization="gguf"), 400)

    blocks = _with_gguf_blocks(snapshot_folder(tmp_path / "q4"), ["Q4_1", "Q8_0"])
    r = deploy(client, blocks, quantization="gguf")
    assert r.status_code == 201, r.text
    assert r.json()["engine"]["quantization"] == "gguf"
    # Neither a new snapshot without blocks, nor a canary of one, under gguf.
    for body in (
        {"snapshot_uri": f"file://{snapshot}"},
        {"snapshot_uri": f"file://{snapshot}", "canary": {"percent": 10}},
    ):
        err = error_of(client.patch("/v1/deployments/tiny", json=body), 400)
        assert err["param"] == "quantization" and "keeps no GGUF blocks" in err["message"]
    # The same snapshot under another quantization is fine, and back to gguf needs the blocks.
    r = client.patch(
        "/v1/deployments/tiny", json={"snapshot_uri": f"file://{snapshot}", "quantization": "int8"}
    )
    assert r.status_code == 200, r.text
    err = error_of(client.patch("/v1/deployments/tiny", json={"quantization": "gguf"}), 400)
    assert err["param"] == "quantization"
    assert client.get("/v1/deployments/tiny").json()["version"] == 2
    # An s3:// snapshot is not read here: its worker refuses the load instead.
    r = client.post(
        "/v1/deployments",
        json={"name": "remote", "snapshot_uri": "s3://models/plain", "quantization": "gguf"},
    )
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    ("body", "param"),
    [({}, None), ({"name": "other"}, "name"), ({"max_replicas": 0}, "max_replicas"),
     ({"min_replicas": 2}, "min_replicas"), ({"snapshot_uri": "http://x"}, "snapshot_uri"),
     ({"unknown": 1}, "unknown"), ([], None)],
)  # fmt: skip
def test_bad_patch_is_400_and_changes_nothing(
    client: TestClient, snapshot: Path, body: Any, param: str | None
) -> None:
    assert deploy(client, snapshot).status_code == 201
    before = client.get("/v1/deployments/tiny").json()
    err = error_of(client.patch("/v1/deployments/tiny", json=body), 400)
    assert err["param"] == param
    assert client.get("/v1/deployments/tiny").json() == before


@pytest.mark.parametrize(
    "uri",
    ["s3://", "s3:///x", "s3://b/p", "s3://bu/p", "s3://-bucket/p", "s3://bucket/p?x=1",
     "s3://bucket/p#frag", "s3://bucket/p\nq", "s3://bu cket/p"],
)  # fmt: skip
def test_an_s3_uri_no_worker_could_fetch_is_400_on_create_and_patch(
    client: TestClient, snapshot: Path, uri: str
) -> None:
    err = error_of(client.post("/v1/deployments", json={"name": "s3", "snapshot_uri": uri}), 400)
    assert err["param"] == "snapshot_uri" and "bucket" in err["message"]
    error_of(client.get("/v1/deployments/s3"), 404)  # nothing was stored
    assert deploy(client, snapshot).status_code == 201
    err = error_of(client.patch("/v1/deployments/tiny", json={"snapshot_uri": uri}), 400)
    assert err["param"] == "snapshot_uri"
    r = client.post("/v1/deployments", json={"name": "ok", "snapshot_uri": "s3://models.v2/a b/"})
    assert r.status_code == 201, r.text
    assert r.json()["snapshot_uri"] == "s3://models.v2/a b"


def test_delete_removes_the_deployment_and_keeps_its_usage(
    client: TestClient, services: Services, snapshot: Path
) -> None:
    assert deploy(client, snapshot).status_code == 201
    services.ledger.record(UsageRecord("req-del", "tiny", "completions", "completed", 3, 4))
    r = client.delete("/v1/deployments/tiny")
    assert r.status_code == 200 and r.json() == {
        "id": "tiny",
        "object": "deployment",
        "deleted": True,
    }
    error_of(client.get("/v1/deployments/tiny"), 404)
    error_of(client.delete("/v1/deployments/tiny"), 404)
    error_of(client.patch("/v1/deployments/tiny", json={"max_replicas": 2}), 404)
    assert client.get("/v1/models").json()["data"] == []
    assert [e.request_id for e in services.ledger.events()] == ["req-del"]
    assert deploy(client, snapshot).status_code == 201  # the name is free again


# --- usage ------------------------------------------------------------------------------------

DAY = timedelta(days=1)
T0 = datetime(2024, 3, 1, tzinfo=UTC)  # a bucket boundary


def record(
    ledger: Ledger, rid: str, deployment: str, at: datetime, p: int, c: int, cached: int = 0
) -> None:
    assert ledger.record(
        UsageRecord(
            request_id=rid,
            deployment=deployment,
            endpoint="chat.completions",
            status="completed",
            prompt_tokens=p,
            completion_tokens=c,
            cached_tokens=cached,
            created_at=at,
        )
    )


def test_usage_default_shape(client: TestClient) -> None:
    r = client.get("/v1/usage")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "page"
    assert body["has_more"] is False
    assert body["next_page"] is None
    buckets = body["data"]
    assert len(buckets) == 7
    now = datetime.now(UTC).timestamp()
    for i, b in enumerate(buckets):
        assert b["object"] == "bucket"
        assert b["results"] == []
        assert b["end_time"] - b["start_time"] == 86400
        assert b["start_time"] % 86400 == 0  # UTC day boundaries
        if i:
            assert b["start_time"] == buckets[i - 1]["end_time"]
    assert buckets[-1]["start_time"] <= now < buckets[-1]["end_time"]  # ends with today


@pytest.mark.parametrize(("width", "count", "seconds"), [("1h", 24, 3600), ("1m", 60, 60)])
def test_usage_default_limit_per_width(
    client: TestClient, width: str, count: int, seconds: int
) -> None:
    buckets = client.get("/v1/usage", params={"bucket_width": width}).json()["data"]
    assert len(buckets) == count
    assert {b["end_time"] - b["start_time"] for b in buckets} == {seconds}


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"bucket_width": "1w"}, "bucket_width"),
        ({"bucket_width": ""}, "bucket_width"),
        ({"limit": "abc"}, "limit"),
        ({"limit": "0"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "32"}, "limit"),
        ({"bucket_width": "1h", "limit": "169"}, "limit"),
        ({"group_by": "user_id"}, "group_by"),
        ({"project_ids": "p"}, "project_ids"),
        ({"start_time": "yesterday"}, "start_time"),
        ({"start_time": "1709251200", "end_time": "1709251200"}, "start_time"),
        ({"start_time": "1709337600", "end_time": "1709251200"}, "start_time"),
        ({"end_time": "99999999999999"}, "end_time"),
        ({"start_time": "-99999999999999"}, "start_time"),
        ({"limit": "\u0661"}, "limit"),  # an Arabic-Indic 1: a digit to int(), not to us
        ({"start_time": "1_700_000_000"}, "start_time"),
        ({"end_time": " 1709251200"}, "end_time"),
        ({"end_time": "0"}, "start_time"),  # no bucket starts before 1970
    ],
)
def test_bad_usage_query_is_400(client: TestClient, params: dict[str, str], param: str) -> None:
    err = error_of(client.get("/v1/usage", params=params), 400)
    assert err["param"] == param


def test_default_usage_buckets_never_start_before_1970(client: TestClient) -> None:
    r = client.get("/v1/usage", params={"end_time": str(2 * 86400 + 5)})
    assert r.status_code == 200, r.text
    assert [b["start_time"] for b in r.json()["data"]] == [0, 86400, 2 * 86400]


def test_usage_sums_records_into_their_buckets(client: TestClient, services: Services) -> None:
    ledger = Ledger(services.db)
    record(ledger, "r1", "alpha", T0 + timedelta(hours=1), 10, 5, cached=4)
    record(ledger, "r2", "alpha", T0 + timedelta(hours=23, minutes=59), 7, 3)
    record(ledger, "r3", "beta", T0 + timedelta(hours=12), 100, 50)
    record(ledger, "r4", "alpha", T0 + DAY + timedelta(hours=2), 1, 1)
    record(ledger, "r5", "alpha", T0 - timedelta(seconds=1), 999, 999)  # before the range
    record(ledger, "r6", "alpha", T0 + 3 * DAY, 999, 999)  # at the (exclusive) end

    start, end = int(T0.timestamp()), int((T0 + 3 * DAY).timestamp())
    params = {"start_time": start, "end_time": end, "group_by": "model"}
    body = client.get("/v1/usage", params=params).json()
    assert [b["start_time"] for b in body["data"]] == [start, start + 86400, start + 2 * 86400]
    assert body["has_more"] is False

    def sums(bucket: dict[str, Any]) -> dict[str, tuple[int, int, int, int]]:
        return {
            r["model"]: (
                r["num_model_requests"],
                r["input_tokens"],
                r["input_cached_tokens"],
                r["output_tokens"],
            )
            for r in bucket["results"]
        }

    day1, day2, day3 = body["data"]
    assert sums(day1) == {"alpha": (2, 17, 4, 8), "beta": (1, 100, 0, 50)}
    assert sums(day2) == {"alpha": (1, 1, 0, 1)}
    assert sums(day3) == {}
    result = day1["results"][0]
    assert result["object"] == "organization.usage.completions.result"

    # Ungrouped: one result per bucket over every deployment.
    body = client.get("/v1/usage", params={"start_time": start, "end_time": end}).json()
    assert [(r["model"], r["num_model_requests"], r["input_tokens"], r["output_tokens"])
            for r in body["data"][0]["results"]] == [(None, 3, 117, 58)]  # fmt: skip

    # One model only.
    body = client.get("/v1/usage", params={**params, "models": "beta"}).json()
    assert [sums(b) for b in body["data"]] == [{"beta": (1, 100, 0, 50)}, {}, {}]


def test_usage_in_hour_buckets(client: TestClient, services: Services) -> None:
    ledger = Ledger(services.db)
    record(ledger, "h1", "alpha", T0 + timedelta(minutes=5), 3, 2)
    record(ledger, "h2", "alpha", T0 + timedelta(minutes=59, seconds=59), 4, 1)
    record(ledger, "h3", "alpha", T0 + timedelta(hours=1), 5, 6)
    start = int(T0.timestamp())
    body = client.get(
        "/v1/usage",
        params={"start_time": start, "end_time": start + 3 * 3600, "bucket_width": "1h"},
    ).json()
    assert [
        [(r["input_tokens"], r["output_tokens"]) for r in b["results"]] for b in body["data"]
    ] == [[(7, 3)], [(5, 6)], []]


def test_usage_limit_truncates_and_says_there_is_more(
    client: TestClient, services: Services
) -> None:
    ledger = Ledger(services.db)
    record(ledger, "in", "alpha", T0 + 2 * DAY + timedelta(hours=23), 5, 5)
    record(ledger, "beyond", "alpha", T0 + 3 * DAY, 7, 7)
    start = int(T0.timestamp())
    params = {"start_time": start, "end_time": start + 10 * 86400, "limit": 3}
    body = client.get("/v1/usage", params=params).json()
    assert [b["start_time"] for b in body["data"]] == [start + i * 86400 for i in range(3)]
    assert [len(b["results"]) for b in body["data"]] == [0, 0, 1]
    assert body["data"][2]["results"][0]["input_tokens"] == 5
    assert body["has_more"] is True


def test_usage_range_that_ends_inside_a_bucket(client: TestClient, services: Services) -> None:
    ledger = Ledger(services.db)
    record(ledger, "a", "alpha", T0 + DAY + timedelta(hours=1), 2, 3)
    record(ledger, "b", "alpha", T0 + DAY + timedelta(hours=13), 50, 50)  # after end_time
    start, end = T0 + timedelta(hours=6), T0 + DAY + timedelta(hours=12)
    params = {"start_time": int(start.timestamp()), "end_time": int(end.timestamp())}
    body = client.get("/v1/usage", params=params).json()
    # Buckets stay on UTC day boundaries even though the range does not.
    assert [b["start_time"] for b in body["data"]] == [
        int(T0.timestamp()),
        int((T0 + DAY).timestamp()),
    ]
    assert [[r["input_tokens"] for r in b["results"]] for b in body["data"]] == [[], [2]]
    assert body["has_more"] is False


def test_usage_over_a_long_range_answers_quickly(client: TestClient) -> None:
    # Years of 1-minute buckets: the page holds `limit` of them and nothing enumerates the rest.
    r = client.get("/v1/usage", params={"start_time": 0, "bucket_width": "1m", "limit": 5})
    assert r.status_code == 200
    body = r.json()
    assert [b["start_time"] for b in body["data"]] == [0, 60, 120, 180, 240]
    assert body["has_more"] is True and body["next_page"] == "300"
    # The cursor continues where the page ended.
    params = {"page": body["next_page"], "bucket_width": "1m", "limit": 2}
    following = client.get("/v1/usage", params=params).json()
    assert [b["start_time"] for b in following["data"]] == [300, 360]


def test_usage_groups_by_deployment_and_api_key_with_cost(
    client: TestClient, services: Services
) -> None:
    ledger = Ledger(services.db)
    PriceStore(services.db).set(None, 150_001, 75_000, 600_000, effective_from=T0)
    key, _ = KeyStore(services.db).create(1, frozenset({"invoke"}))
    for rid, dep, api_key in (
        ("k1", "alpha", key.id),
        ("k2", "alpha", None),
        ("k3", "beta", key.id),
    ):
        assert ledger.record(
            UsageRecord(rid, dep, "completions", "completed", 1000, 10, api_key_id=api_key,
                        created_at=T0 + timedelta(hours=1))
        )  # fmt: skip
    start = int(T0.timestamp())
    base = {"start_time": start, "end_time": start + 86400}

    def results(**params: Any) -> list[tuple[Any, ...]]:
        r = client.get("/v1/usage", params={**base, **params})
        assert r.status_code == 200, r.text
        [bucket] = r.json()["data"]
        return [
            (x["model"], x["api_key_id"], x["num_model_requests"], x["cost"], x["cost_micros"])
            for x in bucket["results"]
        ]

    # 1000 * 0.150001 + 10 * 0.6 = 156.001 micro-units each.
    cost = {"value": "0.000156", "currency": "USD"}
    both = [
        ("alpha", None, 1, cost, 156),
        ("alpha", key.prefix, 1, cost, 156),
        ("beta", key.prefix, 1, cost, 156),
    ]
    assert results(group_by="deployment,api_key") == both
    assert results(group_by=["model", "api_key_id"]) == both  # repeated, OpenAI's names
    assert results(**{"group_by[]": ["api_key", "model"]}) == both  # the openai client's way
    two = {"value": "0.000312", "currency": "USD"}
    assert results(group_by="api_key") == [
        (None, None, 1, cost, 156), (None, key.prefix, 2, two, 312)
    ]  # fmt: skip
    assert results(group_by="deployment") == [
        ("alpha", None, 2, two, 312), ("beta", None, 1, cost, 156)
    ]  # fmt: skip
    assert results() == [(None, None, 3, {"value": "0.000468", "currency": "USD"}, 468)]
    assert results(models="beta,gamma") == [(None, None, 1, cost, 156)]
    assert results(**{"models[]": ["alpha"], "group_by": "api_key"}) == [
        (None, None, 1, cost, 156), (None, key.prefix, 1, cost, 156)
    ]  # fmt: skip


def test_usage_without_prices_has_no_cost(client: TestClient, services: Services) -> None:
    record(Ledger(services.db), "r1", "alpha", T0 + timedelta(hours=1), 10, 5)
    start = int(T0.timestamp())
    body = client.get("/v1/usage", params={"start_time": start, "end_time": start + 7200}).json()
    [result] = body["data"][0]["results"]
    assert (result["cost"], result["cost_micros"], result["input_tokens"]) == (None, None, 10)


@pytest.mark.parametrize(
    "params",
    [{"group_by": "model,user_id"}, {"group_by[]": "project_id"}, {"models": "nul\u0000"}],
)
def test_bad_usage_groups_are_400(client: TestClient, params: dict[str, str]) -> None:
    err = error_of(client.get("/v1/usage", params=params), 400)
    assert err["param"] in ("group_by", "models")


# --- metrics and internal -----------------------------------------------------------------------


def test_metrics_are_prometheus_text(client: TestClient) -> None:
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert "# TYPE hotpool_replicas gauge" in text
    assert "hotpool_workers 0.0" in text
    assert 'hotpool_workers_by_state{state="idle"} 0.0' in text
    assert "# TYPE hotpool_scale_events_total counter" in text
    assert "hotpool_ledger_database_up 1.0" in text
    assert "hotpool_ledger_spool_pending 0.0" in text
    assert "hotpool_ledger_spooled_records_total 0.0" in text
    assert "# TYPE hotpool_requests_total counter" in text
    assert "request_id" not in text


def worker_info(worker_id: str = "w-unknown") -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "address": "http://127.0.0.1:1",
        "pid": 1,
        "device": "cpu",
        "memory_bytes": 0,
    }


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {TOKEN}", TOKEN])
def test_worker_register_needs_the_token(client: TestClient, auth: str | None) -> None:
    headers = {"authorization": auth} if auth else {}
    r = client.post("/internal/workers/register", json=worker_info(), headers=headers)
    err = error_of(r, 401)
    assert err["type"] == "authentication_error"
    r = client.post("/internal/workers/w-unknown/heartbeat", json=worker_info(), headers=headers)
    error_of(r, 401)


def test_unexpected_worker_is_410(client: TestClient) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}
    r = client.post("/internal/workers/register", json=worker_info("w-stranger"), headers=headers)
    assert "w-stranger" in error_of(r, 410)["message"]
    r = client.post(
        "/internal/workers/w-stranger/heartbeat", json=worker_info("w-stranger"), headers=headers
    )
    error_of(r, 404)
    r = client.post(
        "/internal/workers/other/heartbeat", json=worker_info("w-stranger"), headers=headers
    )
    error_of(r, 400)


@pytest.mark.parametrize("body", [{"worker_id": "w"}, ["w"], "w", {**worker_info(), "x": 1}])
def test_malformed_worker_info_is_400(client: TestClient, body: Any) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}
    error_of(client.post("/internal/workers/register", json=body, headers=headers), 400)


@pytest.fixture
def broken_client(services: Services) -> Iterator[TestClient]:
    """A client of an app whose catalog raises, so ``GET /v1/models`` and every invocation
    fail with a 500."""

    def broken(*_: Any) -> Any:
        raise RuntimeError("boom")

    services.catalog.all = broken  # type: ignore[method-assign]
    services.catalog.get = broken  # type: ignore[method-assign]
    with TestClient(create_app(services), raise_server_exceptions=False) as c:
        yield c


def test_server_errors_are_openai_shaped_500s(broken_client: TestClient) -> None:
    err = error_of(broken_client.get("/v1/models"), 500)
    assert err["type"] == "api_error"
    assert "boom" not in err["message"]  # internals stay in the log


def test_server_errors_carry_a_request_id(broken_client: TestClient) -> None:
    assert broken_client.get("/v1/models").headers.get("x-request-id", "").startswith("req_")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"model": "m", "prompt": "hi"}),
    ],
)
def test_a_bug_under_an_invocation_is_a_500_with_its_ids_and_its_log_lines(
    broken_client: TestClient, caplog: pytest.LogCaptureFixture, path: str, body: Any
) -> None:
    # The invocations skip Starlette's stack (hotpool.platform.hot_routes): what its error
    # middleware did for them is still done.
    with caplog.at_level(logging.INFO):
        r = broken_client.post(path, json=body, headers={"x-request-id": "trace-7"})
    err = error_of(r, 500)
    assert err["type"] == "api_error" and "boom" not in r.text  # internals stay in the log
    assert r.headers["x-request-id"] == "trace-7"
    [bug] = [rec for rec in caplog.records if rec.levelno == logging.ERROR]
    assert r.headers["x-hotpool-request-id"] in bug.getMessage() and "boom" in caplog.text
    [line] = [rec for rec in caplog.records if rec.name == "hotpool.access"]
    assert (line.method, line.path, line.status) == ("POST", path, 500)  # type: ignore[attr-defined]


def test_the_invocations_are_served_past_starlettes_routing(client: TestClient) -> None:
    app = client.app
    stack = app.middleware_stack  # type: ignore[attr-defined]

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("went through Starlette's stack")

    app.middleware_stack = refuse  # type: ignore[attr-defined]
    try:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = client.post(path, content=b"{")
            assert "not valid JSON" in error_of(r, 400)["message"]
            assert r.headers["x-request-id"].startswith("req_")
    finally:
        app.middleware_stack = stack  # type: ignore[attr-defined]


def test_a_database_that_refuses_connections_is_a_503_not_a_500(
    client: TestClient, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A route that reads the database while it is unreachable (a real driver, a port
    where nothing listens): 503 with Retry-After, never 'a bug in hotpool'."""
    down = Database("postgresql+psycopg2://postgres@127.0.0.1:1/test")
    monkeypatch.setattr(services.tenants, "db", down)
    try:
        r = client.get("/v1/usage", params={"tenant": "alpha"})
    finally:
        down.dispose()
    error = error_of(r, 503)
    assert error["code"] == "database_unavailable" and r.headers["retry-after"] == "5"


def test_a_client_that_leaves_mid_body_is_a_quiet_499(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """It was a 500 with a traceback in the log (Starlette's ClientDisconnect)."""
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": b'{"model": "x", "mess', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"4000")],
    }  # fmt: skip
    with caplog.at_level(logging.INFO):
        client.portal.call(client.app, scope, receive, send)  # type: ignore[union-attr]
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "Traceback" not in caplog.text


def test_an_answer_longer_than_the_deployment_allows_is_a_400_before_any_replica(
    client: TestClient, services: Services, snapshot: Path
) -> None:
    assert deploy(client, snapshot, max_tokens_limit=64).status_code == 201
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 65}
    err = error_of(client.post("/v1/chat/completions", json=chat), 400)
    assert err["param"] == "max_tokens" and "at most 64" in err["message"]
    prompt = {"model": "tiny", "prompt": "hi", "max_tokens": 1000}
    assert error_of(client.post("/v1/completions", json=prompt), 400)["param"] == "max_tokens"
    native = {"prompt": "hi", "params": {"max_tokens": 65}}
    err = error_of(client.post("/v1/deployments/tiny/invoke", json=native), 400)
    assert err["param"] == "params.max_tokens"
    assert services.pool.replicas("tiny") == []  # refused before admission: nothing started

    # The bounds change at once (no new version: replicas are not involved)...
    r = client.patch("/v1/deployments/tiny", json={"default_max_tokens": 32})
    assert r.status_code == 200, r.text
    assert r.json()["answers"] == {"default_max_tokens": 32, "max_tokens_limit": 64}
    assert r.json()["generation"] == 1
    # ...and stay consistent with each other.
    r = client.patch("/v1/deployments/tiny", json={"max_tokens_limit": 16})
    assert error_of(r, 400)["param"] == "default_max_tokens"
    r = client.patch("/v1/deployments/tiny", json={"default_max_tokens": None})
    assert r.json()["answers"] == {"default_max_tokens": None, "max_tokens_limit": 64}


def test_a_pulled_snapshot_gives_its_deployments_the_catalogs_settings(
    client: TestClient, snapshot: Path
) -> None:
    """`hotpool models pull` writes the catalog's serving settings into the manifest: a
    deployment that leaves them out gets them, one that sets them keeps its own."""
    manifest = read_manifest(snapshot / "manifest.json")
    write_manifest(
        snapshot,
        build_manifest(
            snapshot, manifest.architecture, "bf16", kind="instruct",
            serving={"quantization": "int8", "default_max_tokens": 300},
        ),
    )  # fmt: skip
    made = client.post("/v1/deployments", json={"name": "a", "snapshot_uri": "tiny"}).json()
    assert made["engine"]["quantization"] == "int8"
    assert made["answers"] == {"default_max_tokens": 300, "max_tokens_limit": None}
    own = {"name": "b", "snapshot_uri": "tiny", "quantization": "none", "default_max_tokens": 9}
    made = client.post("/v1/deployments", json=own).json()
    assert made["engine"]["quantization"] == "none"
    assert made["answers"]["default_max_tokens"] == 9
