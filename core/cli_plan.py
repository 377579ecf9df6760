"""`hotpool plan`: how many replicas (and devices: GPUs, or CPU workers) a workload needs for
a TTFT target, from a deployment's measured capacity (``GET /v1/deployments/{name}/capacity``)
and the queueing model of pool/planner.py, with the headroom stated."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import click

from hotpool.cli_common import api_url, call_api

if TYPE_CHECKING:
    from hotpool.pool.capacity import Rates


@click.command()
@click.option("--deployment", "name", required=True, help="Whose measured capacity to plan with.")
@click.option("--rps", type=click.FloatRange(min=0, min_open=True), required=True,
              help="Requests per second (Poisson arrivals).")  # fmt: skip
@click.option("--prompt-tokens", type=click.IntRange(min=1), required=True)
@click.option("--output-tokens", type=click.IntRange(min=1), required=True)
@click.option("--ttft-p95", type=click.FloatRange(min=0, min_open=True), required=True,
              help="Seconds: the 95th percentile time to first token to meet.")  # fmt: skip
@click.option("--headroom", type=click.FloatRange(0, 0.9), default=0.3, show_default=True,
              help="Utilisation each replica keeps free.")  # fmt: skip
@click.option("--devices-per-replica", "--gpus-per-replica", "devices_per_replica",
              type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs (or CPU workers) each replica holds; --gpus-per-replica is its "
              "older name.")  # fmt: skip
@click.option("--url", help="hotpool API (default http://127.0.0.1:$HOTPOOL_PORT).")
def plan(
    name: str,
    rps: float,
    prompt_tokens: int,
    output_tokens: int,
    ttft_p95: float,
    headroom: float,
    devices_per_replica: int,
    url: str | None,
) -> None:
    """Replicas a deployment needs for a workload, from its replicas' measured speed."""
    from hotpool.pool.capacity import Rates
    from hotpool.pool.planner import Workload
    from hotpool.pool.planner import plan as make_plan

    capacity: dict[str, Any] = call_api("GET", f"{api_url(url)}/v1/deployments/{name}/capacity")
    points = tuple((p["step_tokens"], p["tokens_per_second"]) for p in capacity["curve"])
    if not points:
        raise click.ClickException(
            f"{name} has no measured capacity yet: a ready replica measures its speed from "
            "the requests it serves; send it some traffic first"
        )
    rates = Rates(max(v for _, v in points), points)
    work = Workload(rps, prompt_tokens, output_tokens)
    result = make_plan(work, rates, ttft_p95, headroom, devices_per_replica)
    click.echo(
        f"measured: {capacity['measured_replicas']} replica(s) of {name}; a step of 1 token "
        f"runs at {rates.at(1):.1f} tokens/s; {_prefill(rates, prompt_tokens)}"
    )
    if result.replicas is None:
        if result.unreachable:
            raise click.ClickException(f"no replica count meets the target: {result.why}")
        raise click.ClickException(result.why)  # what it would take to tell
    p = result.prediction
    assert p is not None
    click.echo(f"replicas: {result.replicas}")
    click.echo(f"{_device_label(r.get('device') for r in capacity['replicas'])}: {result.devices}")
    click.echo(
        f"per replica: {p.rate:.3g} requests/s, utilisation {p.utilization:.0%} "
        f"(headroom {headroom:.0%}), {p.decode_streams:.1f} streams decoding"
    )
    click.echo(f"predicted TTFT: p95 {p.ttft_p95:.3f}s, mean {p.ttft_mean:.3f}s")
    click.echo(f"why: {result.why}")


def _prefill(rates: Rates, prompt_tokens: int) -> str:
    """What the curve says of a prompt's prefill, and what that rests on: a figure read
    off decode steps alone would mislead (pool/capacity.py, ``Rates.step_time``)."""
    step = rates.step_time(prompt_tokens)
    if step.seconds is None:
        return f"prefill of {prompt_tokens} tokens: not measured yet"
    basis = "" if step.measured else f" (estimated from steps of up to {step.largest} tokens)"
    return f"prefill of {prompt_tokens} tokens takes {step.seconds:.3f}s{basis}"


def _device_label(devices: Iterable[str | None]) -> str:
    """What a plan counts, in the words of the devices the replicas' workers reported:
    GPUs only where they all run on one, CPU workers where they all run on the CPU."""
    kinds = {d.split(":")[0] for d in devices if d}
    if kinds == {"cuda"}:
        return "gpus"
    if kinds == {"cpu"}:
        return "cpu workers"
    return "devices"  # a mix, or a server from before replicas said their device
