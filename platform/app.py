"""Assemble the control plane: database, pool, router, ledger writer, routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from sqlalchemy import text
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.billing.db import Database
from hotpool.billing.deployments import DeploymentStore
from hotpool.billing.keys import KeyStore
from hotpool.billing.ledger import Ledger
from hotpool.billing.scale_events import ScaleEventStore
from hotpool.billing.tenants import TenantStore
from hotpool.platform import (
    admin_api,
    capacity_api,
    dashboard,
    dashboard_api,
    deployments_api,
    internal_api,
    invoke_api,
    openai_routes,
    prices_api,
    usage_api,
)
from hotpool.platform.auth import Authenticator
from hotpool.platform.catalog import DeploymentCatalog
from hotpool.platform.errors import EXCEPTION_HANDLERS
from hotpool.platform.hot_routes import ControlPlaneApp
from hotpool.platform.invoke import Invoker
from hotpool.platform.ledger_writer import LedgerWriter
from hotpool.platform.metrics import Metrics
from hotpool.platform.middleware import RequestIdMiddleware
from hotpool.platform.openapi import openapi_json
from hotpool.platform.router import Router
from hotpool.platform.scale_log import ScaleEventWriter
from hotpool.platform.schema_checks import SchemaChecker
from hotpool.platform.services import Services
from hotpool.platform.worker_mux import WorkerMuxes
from hotpool.pool.autoscaler import Autoscaler
from hotpool.pool.backend import WorkerBackend
from hotpool.pool.pool import ScaleEvent, WorkerPool
from hotpool.pool.registry import WorkerRegistry
from hotpool.pool.replica import Replica
from hotpool.settings import Settings

log = logging.getLogger("hotpool")


def build_services(
    settings: Settings, db: Database, backend: WorkerBackend, worker_token: str
) -> Services:
    registry = WorkerRegistry()
    pool = WorkerPool(
        backend,
        registry,
        worker_token,
        settings.max_workers,
        settings.worker_start_timeout_s,
        warm_workers=settings.warm_workers,
        heartbeat_timeout_s=settings.heartbeat_timeout_s,
        preempt_after_s=settings.preempt_after_s,
    )
    metrics = Metrics(pool)
    catalog = DeploymentCatalog(DeploymentStore(db))
    router = Router(pool, settings.max_queue, settings.queue_timeout_s, routing=settings.routing)
    metrics.queued = router.queued
    metrics.routing_decisions = lambda: router.decisions
    autoscaler = Autoscaler(
        pool,
        catalog.all,
        router.queued_for,
        scale_down_window_s=settings.scale_down_window_s,
        canary_of=catalog.canary_of,
        waiting_work=router.waiting_work,
        backlog_s=settings.scale_backlog_s,
    )
    router.on_demand = autoscaler.wake
    ledger = Ledger(db)
    writer = LedgerWriter(
        ledger, settings.ledger_spool_dir, every_tokens=settings.inflight_every_tokens
    )
    metrics.ledger_writer = writer
    scale_log = ScaleEventWriter(ScaleEventStore(db), catalog.tenant_of)

    def on_scale(event: ScaleEvent) -> None:
        _log_scale(event)
        metrics.observe_scale(event)
        scale_log.submit(event)

    def on_ready(replica: Replica) -> None:
        metrics.observe_cold_start(replica)
        scale_log.cold_start_done(replica)
        # Its first requests can be routed by prefix, where there is a choice to make: a
        # deployment's only replica serves them all, and the fetch (megabytes of tokenizer
        # files sent, parsed and loaded, on the worker and here) cost its first request,
        # under way at that very moment, ~0.15 s to its first token.
        alone = len(pool.replicas(replica.deployment)) < 2
        if replica.error is None and replica.load is not None and not alone:
            router.hasher.prefetch(replica)

    pool.on_scale, pool.on_ready = on_scale, on_ready
    keys = KeyStore(db)
    return Services(
        settings=settings,
        db=db,
        ledger=ledger,
        catalog=catalog,
        registry=registry,
        pool=pool,
        router=router,
        ledger_writer=writer,
        scale_events=scale_log,
        invoker=Invoker(
            router,
            pool.client,
            writer,
            metrics,
            WorkerMuxes(worker_token),
            log_prompts=settings.log_prompts,
        ),
        autoscaler=autoscaler,
        metrics=metrics,
        worker_token=worker_token,
        auth=Authenticator(
            keys,
            enabled=settings.auth_enabled,
            timeout_s=settings.auth_timeout_s,
            grace_s=settings.auth_grace_s,
        ),
        tenants=TenantStore(db),
        keys=keys,
        schemas=SchemaChecker(),
    )


def _warn_about_prompt_logs(limit: int) -> None:
    """Prompts are the users' data: logging them is said out loud, and so is a setting that
    asks for it where the log level keeps it from happening."""
    if not limit:
        return
    if logging.getLogger("hotpool.requests").isEnabledFor(logging.DEBUG):
        log.warning(
            "PROMPTS ARE LOGGED (HOTPOOL_LOG_PROMPTS=%d): every request's prompt and output "
            "go to the log at debug level, up to %d characters each.", limit, limit,
        )  # fmt: skip
    else:
        log.warning(
            "HOTPOOL_LOG_PROMPTS=%d has no effect: prompts are logged at debug level only "
            "(HOTPOOL_LOG_LEVEL=debug).", limit,
        )  # fmt: skip


def _log_scale(event: ScaleEvent) -> None:
    log.info(
        "scale %s: %d -> %d replicas (%s)",
        event.deployment,
        event.from_replicas,
        event.to_replicas,
        event.reason,
    )


async def healthz(_: Request) -> Response:
    """Liveness: the process answers."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Readiness: the database answers and the ledger writer runs (a load balancer sends
    traffic only then)."""
    services: Services = request.app.state.services
    checks: dict[str, str] = {}
    try:
        await asyncio.wait_for(asyncio.to_thread(_ping, services.db), 2.0)
        checks["database"] = "ok"
    except Exception as exc:  # any failure: not ready, and say why
        checks["database"] = f"unreachable: {type(exc).__name__}"
    checks["ledger_writer"] = "ok" if services.ledger_writer.running else "stopped"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse(
        {"status": "ready" if ready else "not_ready", "checks": checks},
        status_code=200 if ready else 503,
    )


def _ping(db: Database) -> None:
    with db.engine.connect() as conn:
        conn.execute(text("SELECT 1"))


async def metrics(request: Request) -> Response:
    services: Services = request.app.state.services
    return Response(
        services.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


def create_app(services: Services) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not services.auth.enabled:
            log.warning(
                "AUTHENTICATION IS OFF (local-only mode): every caller acts as the default "
                "tenant with every scope. Set HOTPOOL_AUTH=keys and create keys with "
                "`hotpool keys create` before exposing this server."
            )
        _warn_about_prompt_logs(services.settings.log_prompts)
        # First: bill what a previous process left in flight, and replay its spool.
        await services.ledger_writer.start()
        services.scale_events.start()
        services.pool.start()  # fill the warm pool in the background
        scaler = asyncio.create_task(services.autoscaler.run(), name="autoscaler")
        try:
            yield
        finally:
            scaler.cancel()
            await asyncio.gather(scaler, return_exceptions=True)
            await services.pool.shutdown()
            await services.invoker.close()
            # After the pool, so every request has ended: each record goes to the database,
            # or to the spool if it is down; nothing metered is lost on a clean stop.
            await services.ledger_writer.close()
            await services.scale_events.close()
            services.schemas.close()

    routes = [
        *openai_routes.routes,
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        *deployments_api.routes,
        *capacity_api.routes,
        *invoke_api.routes,
        *usage_api.routes,
        *dashboard_api.routes,
        *dashboard.routes,
        *admin_api.routes,
        *prices_api.routes,
        *internal_api.routes,
    ]
    app = ControlPlaneApp(
        hot=openai_routes.invocations,
        routes=routes,
        middleware=[Middleware(RequestIdMiddleware, auth_off=not services.auth.enabled)],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        lifespan=lifespan,
    )
    app.state.services = services
    return app
