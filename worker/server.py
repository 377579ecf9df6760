"""The worker's internal HTTP API (never public): bearer token on everything but /health.

``POST /load``, ``POST /unload``, ``POST /generate`` (NDJSON stream of GenerateEvent),
``POST /generate/mux`` (many generations on one connection: ``hotpool.worker.mux``),
``POST /abort/{request_id}``, ``GET /health``, ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from hotpool.streaming import ChunkStream
from hotpool.worker.engine.base import RequestRejected
from hotpool.worker.models.loader import ModelLoadError
from hotpool.worker.mux import Multiplexer
from hotpool.worker.protocol import GenerateEvent, GenerateRequest, LoadRequest
from hotpool.worker.service import NotLoaded, WorkerService
from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.tokenizer import TOKENIZER_FILES, TemplateError

log = logging.getLogger(__name__)


class BearerAuth:
    """Pure ASGI middleware: the shared worker token, compared in constant time."""

    def __init__(
        self, app: ASGIApp, token: str, open_paths: tuple[str, ...] = ("/health",)
    ) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                await _error(401, "invalid worker token", "authentication_error")(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


def _error(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}, status
    )


class _EngineCollector(Collector):
    """Engine gauges and counters, read from the loaded engine at scrape time."""

    def __init__(self, service: WorkerService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        loaded = self.service.loaded
        reqs = GaugeMetricFamily(
            "hotpool_engine_requests", "Requests in the engine", labels=["state"]
        )
        kv = GaugeMetricFamily("hotpool_kv_cache_usage_ratio", "Fraction of KV cache blocks in use")
        queries = CounterMetricFamily(
            "hotpool_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        hits = CounterMetricFamily(
            "hotpool_prefix_cache_hits", "Prompt tokens served from the prefix cache"
        )
        preempt = CounterMetricFamily(
            "hotpool_preemptions", "Requests preempted for lack of KV blocks"
        )
        proposed = CounterMetricFamily(
            "hotpool_spec_proposed_tokens", "Tokens speculative decoding proposed"
        )
        accepted = CounterMetricFamily(
            "hotpool_spec_accepted_tokens", "Proposed tokens the model accepted"
        )
        enabled = GaugeMetricFamily(
            "hotpool_spec_enabled", "1 while the automatic switch has speculation on"
        )
        if loaded is not None and loaded.engine.engine.spec is not None:
            s = loaded.engine.engine.stats()
            proposed.add_metric([], s.spec_proposed)
            accepted.add_metric([], s.spec_accepted)
            enabled.add_metric([], float(s.spec_enabled))
        yield from (proposed, accepted, enabled)
        if loaded is not None:
            s = loaded.engine.engine.stats()
            reqs.add_metric(["running"], s.num_running)
            reqs.add_metric(["waiting"], s.num_waiting)
            kv.add_metric([], s.kv_usage)
            queries.add_metric([], s.prefix_cache_queries)
            hits.add_metric([], s.prefix_cache_hits)
            preempt.add_metric([], s.num_preemptions)
        yield from (reqs, kv, queries, hits, preempt)


class WorkerMetrics:
    def __init__(self, service: WorkerService) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(service))
        self.step_seconds = Histogram(
            "hotpool_engine_step_seconds",
            "Time of one engine step (one forward pass and sampling)",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
            registry=self.registry,
        )
        self.step_tokens = Histogram(
            "hotpool_engine_step_tokens",
            "Tokens computed per engine step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
            registry=self.registry,
        )
        self.requests = Counter(
            "hotpool_worker_requests",
            "Generated choices by finish reason",
            ["finish_reason"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "hotpool_worker_tokens", "Tokens processed", ["kind"], registry=self.registry
        )
        self.cold_start = Histogram(
            "hotpool_worker_cold_start_seconds",
            "Cold-start time by phase",
            ["phase"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=self.registry,
        )

    def observe_step(self, seconds: float, tokens: int) -> None:
        self.step_seconds.observe(seconds)
        self.step_tokens.observe(tokens)

    def finished(self, reason: str) -> None:
        """A choice ended with ``reason``."""
        self.requests.labels(reason).inc()

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        """A request's exact usage, from the last event of its stream."""
        self.tokens.labels("prompt").inc(prompt_tokens)
        self.tokens.labels("completion").inc(completion_tokens)


def build_worker_app(
    service: WorkerService,
    token: str,
    worker_id: str,
    stopping: Callable[[], bool] = lambda: False,
) -> ASGIApp:
    """``stopping``: whether the server is shutting down (``/generate/mux`` then takes no
    new requests and ends once idle)."""
    metrics = WorkerMetrics(service)

    async def health(_: Request) -> Response:
        loaded = service.loaded
        return JSONResponse(
            {
                "status": "ok",
                "worker_id": worker_id,
                "device": str(service.device),
                "loaded": loaded.deployment if loaded else None,
                "digest": loaded.digest if loaded else None,
                "active_requests": loaded.engine.num_active if loaded else 0,
            }
        )

    async def load(request: Request) -> Response:
        body = await _json(request)
        if not isinstance(body, dict) or not body.get("snapshot_uri") or not body.get("deployment"):
            return _error(400, "body must be {deployment, snapshot_uri, dtype?}")
        try:
            result = await service.load(LoadRequest(**body))
        except (SnapshotError, ModelLoadError, KeyError, TypeError) as exc:
            return _error(422, f"cannot load {body.get('snapshot_uri')}: {exc}")
        for phase, seconds in result.phases.items():
            metrics.cold_start.labels(phase).observe(seconds)
        loaded = service.loaded
        if loaded is not None:
            meter = loaded.capacity

            def on_step(seconds: float, tokens: int) -> None:
                metrics.observe_step(seconds, tokens)
                meter.observe(seconds, tokens)

            loaded.engine.engine.on_step = on_step
        return JSONResponse(result.to_json())

    async def unload(_: Request) -> Response:
        await service.unload()
        return JSONResponse({"status": "unloaded"})

    async def abort(request: Request) -> Response:
        return JSONResponse({"aborted": service.abort(request.path_params["request_id"])})

    async def generate(request: Request) -> Response:
        body = await _json(request)
        try:
            req = GenerateRequest.from_json(body)
        except (KeyError, TypeError, AttributeError) as exc:
            return _error(400, f"malformed generate request: {exc}")
        events = service.generate(req)
        try:
            first = await anext(events)  # validation errors surface here, before any byte is sent
        except NotLoaded as exc:
            return _error(409, str(exc), "not_loaded")
        except (RequestRejected, TemplateError) as exc:
            return _error(400, str(exc), code=getattr(exc, "code", None))
        return ChunkStream(_ndjson(first, events, metrics), "application/x-ndjson")

    async def tokenizer(_: Request) -> Response:
        """The loaded snapshot's tokenizer files, for the router's prompt hashes."""
        loaded = service.loaded
        if loaded is None:
            return _error(409, "no model is loaded on this worker", "not_loaded")
        files = {}
        for name in TOKENIZER_FILES:
            path = loaded.tokenizer.snapshot_dir / name
            if path.is_file():
                files[name] = await asyncio.to_thread(path.read_text)
        if "tokenizer.json" not in files:  # the disk cache let the snapshot go
            return _error(404, "the loaded snapshot's tokenizer files are gone", "not_found")
        return JSONResponse({"digest": loaded.digest, "files": files})

    async def prom(_: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/load", load, methods=["POST"]),
            Route("/unload", unload, methods=["POST"]),
            Route("/generate", generate, methods=["POST"]),
            Route("/generate/mux", Multiplexer(service, metrics, stopping), methods=["POST"]),
            Route("/abort/{request_id}", abort, methods=["POST"]),
            Route("/tokenizer", tokenizer),
            Route("/metrics", prom),
        ]
    )
    return BearerAuth(app, token)


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


async def _ndjson(
    first: GenerateEvent, rest: AsyncIterator[GenerateEvent], metrics: WorkerMetrics
) -> AsyncIterator[bytes]:
    event: GenerateEvent | None = first
    last = first
    try:
        while event is not None:
            if event.finish_reason is not None:
                metrics.finished(event.finish_reason)
            yield (json.dumps(event.to_json()) + "\n").encode()
            last, event = event, await anext(rest, None)
        if last.usage is not None:  # the stream's last event: the request's exact usage
            metrics.usage(last.usage.prompt_tokens, last.usage.completion_tokens)
    except Exception as exc:  # a failure mid-stream ends it with an error event
        log.exception("generation failed")
        yield (
            json.dumps(GenerateEvent(finish_reason="error", error=str(exc)).to_json()) + "\n"
        ).encode()
    finally:
        await rest.aclose()  # client gone: closing the generator aborts the engine request
