"""Assemble the control plane: database, pool, router, ledger writer, routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.billing.db import Database
from hotpool.billing.deployments import DeploymentStore
from hotpool.billing.ledger import Ledger
from hotpool.platform import deployments_api, internal_api, openai_routes, usage_api
from hotpool.platform.catalog import DeploymentCatalog
from hotpool.platform.errors import EXCEPTION_HANDLERS
from hotpool.platform.invoke import Invoker
from hotpool.platform.ledger_writer import LedgerWriter
from hotpool.platform.metrics import Metrics
from hotpool.platform.middleware import RequestIdMiddleware
from hotpool.platform.router import Router
from hotpool.platform.services import Services
from hotpool.pool.autoscaler import Autoscaler
from hotpool.pool.backend import WorkerBackend
from hotpool.pool.pool import ScaleEvent, WorkerPool
from hotpool.pool.registry import WorkerRegistry
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
        on_scale=_log_scale,
    )
    metrics = Metrics(pool)
    pool.on_ready = metrics.observe_cold_start
    catalog = DeploymentCatalog(DeploymentStore(db))
    router = Router(pool, settings.max_queue, settings.queue_timeout_s)
    ledger = Ledger(db)
    writer = LedgerWriter(ledger)
    return Services(
        settings=settings,
        db=db,
        ledger=ledger,
        catalog=catalog,
        registry=registry,
        pool=pool,
        router=router,
        ledger_writer=writer,
        invoker=Invoker(router, pool.client, writer, metrics),
        autoscaler=Autoscaler(pool, catalog.all),
        metrics=metrics,
        worker_token=worker_token,
    )


def _log_scale(event: ScaleEvent) -> None:
    log.info(
        "scale %s: %d -> %d replicas (%s)",
        event.deployment,
        event.from_replicas,
        event.to_replicas,
        event.reason,
    )


async def healthz(_: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    services: Services = request.app.state.services
    return Response(
        services.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


def create_app(services: Services) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        services.ledger_writer.start()
        services.pool.start()  # fill the warm pool in the background
        scaler = asyncio.create_task(services.autoscaler.run(), name="autoscaler")
        try:
            yield
        finally:
            scaler.cancel()
            await asyncio.gather(scaler, return_exceptions=True)
            await services.pool.shutdown()
            await services.ledger_writer.close()  # nothing metered is lost on a clean stop

    routes = [
        Route("/healthz", healthz),
        Route("/metrics", metrics),
        *openai_routes.routes,
        *deployments_api.routes,
        *usage_api.routes,
        *internal_api.routes,
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(RequestIdMiddleware)],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        lifespan=lifespan,
    )
    app.state.services = services
    return app
