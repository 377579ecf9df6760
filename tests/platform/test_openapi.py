"""``/openapi.json``: a valid OpenAPI 3.1 document that covers every public route and that the
app keeps. Schemathesis fuzzes each operation of the real app in process (a real SQLite
database, API keys, a deployment) and checks every answer against the document: no server
error, a documented status, media type, body and headers.

No worker process ever starts. Invocations either meet a backend that refuses to start
workers (a cold start that fails at once: the documented 503 with ``Retry-After``), or, to
reach the success path, an invoker that answers like a replica would without one.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.transport import Response as StResponse
from schemathesis.python import asgi as schemathesis_asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from snapshot_folders import snapshot_folder
from starlette.applications import Starlette
from starlette.routing import Route

from hotpool.billing.db import Database
from hotpool.billing.deployments import DeploymentSpec, DeploymentStore
from hotpool.billing.keys import KeyStore
from hotpool.billing.tenants import TenantStore
from hotpool.platform import deployment_schema, invoke_api, prices_api, schemas, usage_api
from hotpool.platform.app import build_services, create_app
from hotpool.platform.invoke import Caller, Served
from hotpool.platform.openapi import DOCUMENT
from hotpool.platform.router import Target
from hotpool.platform.schemas import CompletionCall
from hotpool.platform.services import Services
from hotpool.pool.backend import WorkerHandle
from hotpool.pool.local import LocalProcessBackend, LocalWorkerConfig
from hotpool.settings import load_settings
from hotpool.worker.protocol import GenerateEvent, PositionLogprobs, TokenLogprob, Usage

JSON = "application/json"
METHODS = {"get", "post", "patch", "delete", "put"}
OPERATIONS = sorted((path, method) for path, item in DOCUMENT["paths"].items() for method in item)
INVOCATIONS = [
    ("/v1/chat/completions", "post"),
    ("/v1/completions", "post"),
    ("/v1/deployments/{name}/invoke", "post"),
]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
# A 503 is no bug when the operation documents it (status_code_conformance) with its
# Retry-After (response_headers_conformance): with no workers, that is how invocations end.
# Keys are the test's to choose (an admin's, a usage-only one's, none), not the generator's.
CONFIG = schemathesis.Config.from_dict(
    {
        "checks": {"not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "503"]}},
        "generation": {"with-security-parameters": False},
    }
)
# Reproducible in CI (derandomize: the same examples every run, no example database) and
# about a second per operation on two CPUs.
FUZZ = settings(
    max_examples=50,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)


@schemathesis.deserializer("application/x-ndjson")
def _ndjson(_: Any, response: StResponse) -> list[Any]:
    """The native invoke stream, one JSON value a line (documented as their array)."""
    return [json.loads(line) for line in response.content.decode().splitlines() if line]


class NoWorkers(LocalProcessBackend):
    """A local backend that refuses to start worker processes: every cold start fails at
    once, so an invocation ends in the documented 503 instead of waiting for a worker."""

    async def start(self, worker_id: str) -> WorkerHandle:
        raise RuntimeError("this test starts no worker processes")


class ScriptedInvoker:
    """Answers like a replica would (``n`` choices, logprobs when asked, a tool call when the
    model may make one, usage on the last event), so the success path of every invocation
    route meets the document too."""

    async def close(self) -> None:
        pass

    async def generate(
        self,
        target: Target,
        call: CompletionCall,
        request_id: str,
        caller: Caller,
        served: Served | None = None,
    ) -> AsyncIterator[GenerateEvent]:
        if served is not None:
            served.version = target.version
        p = call.params
        finishes = ("stop", "length", "abort")
        calls = call.tools is not None and call.tool_choice != "none"
        for i in range(p.n):
            for step, text in enumerate(("Hel", "lo\ufffd", "")):
                last = step == 2
                tool_calls: tuple[dict[str, Any], ...] = ()
                if calls and last:  # the model called a tool: OpenAI's pieces of it
                    first = {"name": "f", "arguments": ""}
                    tool_calls = (
                        {"index": 0, "id": "call_1", "type": "function", "function": first},
                        {"index": 0, "function": {"arguments": '{"a":1}'}},
                    )
                positions = ()
                if p.logprobs is not None and not last:
                    top = tuple(
                        TokenLogprob(9 + k, f"t{k}", -1.0 - k, (116,)) for k in range(p.logprobs)
                    )
                    positions = (
                        PositionLogprobs(TokenLogprob(5 + step, text, -0.5, (72, 0xE2)), top),
                    )
                yield GenerateEvent(
                    text=text,
                    token_ids=() if last else (5 + step,),
                    finish_reason=("tool_calls" if calls else finishes[i % 3]) if last else None,
                    usage=Usage(3, 2 * (i + 1), 1) if last and i == p.n - 1 else None,
                    index=i,
                    logprobs=positions,
                    tool_calls=tool_calls,
                )


@dataclass
class World:
    """The app under test and the names that exist in it."""

    services: Services
    app: Starlette
    schema: Any
    snapshot: Path
    keys: dict[str, str]  # who -> plaintext key
    spare_prefix: str  # a key the fuzzer may revoke

    def headers(self, who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[who]}"} if who in self.keys else {}

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """A request as an admin, through the app's running lifespan."""
        with schemathesis_asgi.get_client(self.app) as client:
            return client.request(method, path, headers=self.headers("admin"), **kwargs)

    def ensure_deployment(self) -> None:
        """Put ``tiny`` back after a fuzzed DELETE."""
        if self.services.catalog.get("tiny") is None:
            body = {"name": "tiny", "snapshot_uri": f"file://{self.snapshot}"}
            r = self.request("POST", "/v1/deployments", json=body)
            assert r.status_code == 201, r.text

    def aim(self, case: Any) -> None:
        """Point a generated case at objects that exist, so it gets past the 404s."""
        params = case.path_parameters or {}
        for name, value in (("name", "tiny"), ("model", "tiny"), ("prefix", self.spare_prefix)):
            if name in params:
                params[name] = value
        if isinstance(case.body, dict):
            renames = case.operation.method.upper() == "PATCH"  # only to its own name
            for name, value in (("model", "tiny"), ("tenant", "fuzz"), ("name", "tiny"),
                                ("snapshot_uri", f"file://{self.snapshot}"),
                                ("min_replicas", 0)):  # fmt: skip
                if name in case.body and (name != "name" or renames):
                    case.body[name] = value


def _world(home: Path, invoker: ScriptedInvoker | None = None) -> Iterator[World]:
    settings_ = load_settings(
        {
            "HOTPOOL_HOME": str(home),
            "HOTPOOL_WARM_WORKERS": "0",
            "HOTPOOL_MAX_WORKERS": "1",
            "HOTPOOL_AUTH": "keys",
            "HOTPOOL_QUEUE_TIMEOUT_S": "2",  # a bound, should anything wait for a replica
        }
    )
    db = Database(settings_.database_url)
    db.upgrade()
    tenant = TenantStore(db).create("fuzz")
    keystore = KeyStore(db)
    keys = {who: keystore.create(tenant.id, scopes)[1] for who, scopes in
            (("admin", "operator"), ("usage", "usage"))}  # fmt: skip
    spare, _ = keystore.create(tenant.id, "invoke", "spare")
    snapshot = snapshot_folder(home / "objects" / "snapshots" / "tiny")
    DeploymentStore(db).create(DeploymentSpec("tiny", f"file://{snapshot}", tenant_id=tenant.id))
    backend = NoWorkers(LocalWorkerConfig("http://127.0.0.1:9", "t", settings_.cache_dir, home))
    services = build_services(settings_, db, backend, "t")
    if invoker is not None:
        services.invoker = invoker  # type: ignore[assignment]
    app = create_app(services)
    try:
        schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)
        yield World(services, app, schema, snapshot, keys, spare.prefix)
    finally:
        schemathesis_asgi.shutdown_lifespans()  # the app's lifespan: pool, ledger writer
        db.dispose()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    yield from _world(tmp_path_factory.mktemp("openapi"))


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    yield from _world(tmp_path_factory.mktemp("openapi-scripted"), ScriptedInvoker())


def _stream(case: Any, data: st.DataObject) -> None:
    """Ask for a stream (and its usage chunk) often: a generated body seldom does."""
    if isinstance(case.body, dict) and data.draw(st.booleans(), label="stream"):
        case.body["stream"] = True
        if case.operation.path.startswith("/v1/") and "invoke" not in case.operation.path:
            usage = data.draw(st.sampled_from([None, {}, {"include_usage": True}]))
            case.body["stream_options"] = usage


def _fuzz(world: World, path: str, method: str, who: Any, succeed: bool = False) -> None:
    """Fuzz one operation: valid and invalid requests, by ``who`` (admin, usage or nobody);
    ``succeed``: mostly valid invocations of the deployment, streamed or not."""
    operation = world.schema[path][method]
    positive, negative = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
    modes = [positive] * 3 + [negative] if succeed else [positive, negative]

    @FUZZ
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        mode = data.draw(st.sampled_from(modes), label="mode")
        case = data.draw(operation.as_strategy(generation_mode=mode), label="case")
        if succeed or data.draw(st.booleans(), label="aim at existing objects"):
            world.aim(case)
        if succeed:
            _stream(case, data)
        world.ensure_deployment()
        case.call_and_validate(headers=world.headers(data.draw(who, label="who")), checks=CHECKS)

    run()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("path", "method"), OPERATIONS, ids=[f"{m} {p}" for p, m in OPERATIONS])
def test_fuzzed_requests_get_documented_answers(world: World, path: str, method: str) -> None:
    # Mostly an admin key (to get past auth), sometimes none or one lacking the scope.
    _fuzz(world, path, method, st.sampled_from(["admin"] * 6 + ["nobody", "usage"]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("path", "method"), INVOCATIONS, ids=[p for p, _ in INVOCATIONS])
def test_fuzzed_invocations_that_succeed_match_the_document(
    scripted: World, path: str, method: str
) -> None:
    _fuzz(scripted, path, method, st.just("admin"), succeed=True)


# --- the document itself ------------------------------------------------------------------


def test_the_document_is_valid_openapi_3_1_served_without_a_key(world: World) -> None:
    validate(DOCUMENT)
    assert DOCUMENT["openapi"].startswith("3.1")
    with schemathesis_asgi.get_client(world.app) as client:  # the lifespan the fuzzer runs
        r = client.get("/openapi.json")  # HOTPOOL_AUTH=keys, and no key
    assert r.status_code == 200
    assert r.headers["content-type"] == JSON
    assert r.json() == json.loads(json.dumps(DOCUMENT))
    assert r.headers["x-request-id"].startswith("req_")


def _routes(app: Starlette) -> set[tuple[str, str]]:
    found = set()
    for route in app.routes:
        assert isinstance(route, Route)
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)  # {model:path} -> {model}
        # Workers' API, the document itself and the dashboard's web page are not the API.
        if path.startswith(("/internal/", "/dashboard")) or path == "/openapi.json":
            continue
        found |= {(path, m.lower()) for m in route.methods or () if m != "HEAD"}
    return found


def test_every_public_route_is_documented_and_nothing_else(world: World) -> None:
    documented = {(p, m) for p, item in DOCUMENT["paths"].items() for m in item if m in METHODS}
    assert _routes(world.app) == documented
    assert not any(p.startswith("/internal") for p, _ in documented)


def _body(path: str, method: str) -> dict[str, Any]:
    schema = DOCUMENT["paths"][path][method]["requestBody"]["content"][JSON]["schema"]
    return schema  # type: ignore[no-any-return]


def _conforms(value: Any, component: str) -> None:
    schema = {"$ref": f"#/components/schemas/{component}", "components": DOCUMENT["components"]}
    jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)


def test_a_tool_call_conversation_and_its_answers_match_the_document(scripted: World) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    body = {"model": "tiny", "messages": messages, "tools": [tool], "tool_choice": "required"}
    schema = _body("/v1/chat/completions", "post")
    jsonschema.validate(body, {**schema, "components": DOCUMENT["components"]})
    r = scripted.request("POST", "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    _conforms(r.json(), "ChatCompletion")
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"a":1}'
    r = scripted.request("POST", "/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
    for chunk in chunks:
        _conforms(chunk, "ChatCompletionChunk")
    assert any(ch["delta"].get("tool_calls") for c in chunks for ch in c["choices"])


def test_request_schemas_name_exactly_the_fields_the_parsers_accept() -> None:
    def fields(path: str, method: str) -> set[str]:
        return set(_body(path, method)["properties"])

    assert fields("/v1/chat/completions", "post") == schemas.CHAT_FIELDS
    assert fields("/v1/completions", "post") == schemas.COMPLETION_FIELDS
    assert fields("/v1/deployments/{name}/invoke", "post") == invoke_api.INVOKE_FIELDS
    params = _body("/v1/deployments/{name}/invoke", "post")["properties"]["params"]["anyOf"][0]
    assert set(params["properties"]) == invoke_api.PARAM_FIELDS
    settable = {"name", *deployment_schema.PARSERS}
    assert fields("/v1/deployments", "post") == settable
    assert fields("/v1/deployments/{name}", "patch") == settable | {"canary"}
    assert fields("/v1/tenants", "post") == {"name"}
    assert fields("/v1/keys", "post") == {"tenant", "scopes", "name"}
    assert fields("/v1/prices", "post") == prices_api.FIELDS
    usage = DOCUMENT["paths"]["/v1/usage"]["get"]["parameters"][1:]
    assert {p["name"] for p in usage} == usage_api.PARAMS
    for path, method in OPERATIONS:
        if "requestBody" in DOCUMENT["paths"][path][method]:
            assert _body(path, method)["additionalProperties"] is False  # unknown fields: 400


def test_every_error_answer_has_the_openai_shape_and_the_ids(world: World) -> None:
    components = DOCUMENT["components"]["responses"]
    for path, method in OPERATIONS:
        for status, answer in DOCUMENT["paths"][path][method]["responses"].items():
            if status.startswith(("4", "5")) and path != "/readyz":
                answer = components[answer["$ref"].rsplit("/", 1)[1]]
                assert answer["content"][JSON]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"
                }
                assert ("Retry-After" in answer["headers"]) == (status in ("429", "503"))
            headers = answer.get("headers", {})
            assert {"x-request-id", "x-hotpool-request-id"} <= set(headers), (path, status)


BIG = 10**400  # an integer no float holds
S3 = "s3://bucket/prefix"
# Found while writing and fuzzing this document: each was a 500 (a float or SQL integer
# overflow, a JSON parser limit, a store's own check), a control plane stalled creating
# replicas (min_replicas 20000), or a name with a newline accepted; each is now a 400.
BUGS = [
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 1' + b"0" * 5000 + b"}",
     None),
    ("POST", "/v1/chat/completions", b"[" * 100_000, None),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "temperature": BIG},
     "temperature"),
    ("POST", "/v1/deployments/tiny/invoke", {"prompt": "x", "params": {"top_p": -BIG}},
     "params.top_p"),
    ("POST", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": 1 << 64}, "seed"),
    ("POST", "/v1/deployments", {"name": "big", "snapshot_uri": S3, "max_replicas": 1 << 40},
     "max_replicas"),
    ("POST", "/v1/deployments", {"name": "big", "snapshot_uri": S3, "idle_timeout_s": BIG},
     "idle_timeout_s"),
    ("POST", "/v1/deployments", {"name": "big\n", "snapshot_uri": S3}, "name"),
    ("PATCH", "/v1/deployments/tiny", {"kv_cache_bytes": 1 << 70}, "kv_cache_bytes"),
    ("PATCH", "/v1/deployments/tiny", {"max_replicas": 20_000, "min_replicas": 20_000},
     "min_replicas"),
    ("GET", f"/v1/deployments/tiny/events?before={1 << 70}", None, "before"),
    ("POST", "/v1/keys", {"tenant": "fuzz", "scopes": ["invoke"], "name": ""}, "name"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body", "param"), BUGS)
def test_inputs_that_once_broke_the_server_are_400s(
    world: World, method: str, path: str, body: Any, param: str | None
) -> None:
    world.ensure_deployment()
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    r = world.request(method, path, **kwargs)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_documented_local_only_mode_is_the_settings_default() -> None:
    """The document and the README said different things of when no key is needed: both
    name the default the settings have (`auto`, keyless on a loopback-only server)."""
    default = load_settings({}).auth
    assert default == "auto"
    described = DOCUMENT["info"]["description"]
    assert f"`HOTPOOL_AUTH={default}` on a server that listens on loopback only" in described
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert f"`HOTPOOL_AUTH` is `keys`, `none` or `{default}` (the default)" in readme
