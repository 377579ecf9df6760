"""``GET /v1/deployments/{name}/capacity``: what a deployment's replicas measured they can
do (tokens/s by step size, from their engines' own steps), the backlog each holds, the
device each runs on, and the mean output its requests produce: what ``hotpool plan`` sizes
a deployment with (in GPUs, or CPU workers, as the devices say)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.platform.auth import authorize
from hotpool.platform.deployments_api import owned_or_404
from hotpool.platform.services import Services
from hotpool.pool.capacity import Rates, backlog_seconds, mean_rates, rates
from hotpool.pool.replica import ReplicaState


def _curve(r: Rates | None) -> list[dict[str, float]]:
    if r is None:
        return []
    return [{"step_tokens": size, "tokens_per_second": rate} for size, rate in r.curve]


async def get_capacity(request: Request) -> Response:
    principal = await authorize(request, "deploy")
    services: Services = request.app.state.services
    name = request.path_params["name"]
    spec = owned_or_404(services, name, principal)
    replicas, measured = [], []
    for r in services.pool.replicas(name):
        if r.state is not ReplicaState.READY:
            continue
        x = rates(r.capacity)
        if x is not None:
            measured.append(x)
        backlog = (
            None if x is None
            else backlog_seconds(r.queued_tokens, r.queued_output_tokens, r.inflight, x)
        )  # fmt: skip
        replicas.append(
            {
                "id": r.id,
                "version": r.generation,
                "curve": _curve(x),
                "inflight": r.inflight,
                "queued_prompt_tokens": r.queued_tokens,
                "queued_output_tokens": r.queued_output_tokens,
                "backlog_seconds": backlog,
                "kv_cache_usage": r.kv_cache_usage,
                # What its worker runs on, as it registered ("cuda", "cpu"): a plan counts
                # GPUs only where there are some.
                "device": r.worker.device if r.worker else None,
            }
        )
    typical = mean_rates(measured)
    return JSONResponse(
        {
            "deployment": name,
            "replicas": replicas,
            "curve": _curve(typical),  # the mean replica's
            "measured_replicas": len(measured),
            "output_tokens_mean": services.router.output_means.get(name),
            "scale_backlog_s": services.settings.scale_backlog_s,
            "target_concurrency": spec.target_concurrency,
        }
    )


routes = [Route("/v1/deployments/{name}/capacity", get_capacity, methods=["GET"])]
