"""The ``hotpool`` command line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from hotpool import __version__
from hotpool.cli_common import api_url as _api_url
from hotpool.cli_common import call_api as _call
from hotpool.cli_common import print_table
from hotpool.cli_common import settings_or_exit as _settings
from hotpool.cli_common import snapshot_uri as _snapshot_uri
from hotpool.cli_keys import keys, tenants
from hotpool.cli_ledger import ledger
from hotpool.cli_plan import plan
from hotpool.cli_prices import prices
from hotpool.cli_snapshot import models, snapshot
from hotpool.cli_versions import describe, promote, rollback, versions
from hotpool.logs import configure as configure_logs


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hotpool")
def main() -> None:
    """hotpool: a self-hosted serverless GPU platform for language models.

    Settings come from HOTPOOL_* environment variables; data lives in $HOTPOOL_HOME
    (default ~/.hotpool).
    """


@main.command()
@click.option("--host", help="Address to listen on (HOTPOOL_HOST, default 127.0.0.1).")
@click.option(
    "--port", type=int, help="Port to listen on (HOTPOOL_PORT, default 8000; 0 = any free port)."
)
@click.option(
    "--deploy",
    "deploys",
    multiple=True,
    metavar="NAME[=SNAPSHOT]",
    help="Create this deployment at start if it does not exist (scaled to zero). SNAPSHOT is a "
    "URI or a name in the local object store; it defaults to NAME. Repeatable.",
)
def serve(host: str | None, port: int | None, deploys: tuple[str, ...]) -> None:
    """Run the control plane and its local worker pool."""
    from dataclasses import replace

    from hotpool.billing.deployments import DeploymentSpec
    from hotpool.platform.deployment_schema import snapshot_serving_defaults
    from hotpool.platform.server import StartupError
    from hotpool.platform.server import serve as run_server

    settings = _settings()
    settings = replace(
        settings, host=host or settings.host, port=settings.port if port is None else port
    )
    configure_logs(settings.log_level, settings.log_format)
    specs = []
    for item in deploys:
        name, _, snapshot = item.partition("=")
        uri = _snapshot_uri(settings, snapshot or name)
        if (
            uri.startswith("file://")
            and not (Path(uri.removeprefix("file://")) / "manifest.json").exists()
        ):
            raise click.ClickException(
                f"--deploy {item}: no snapshot at {uri} (try `hotpool models pull {name}`)"
            )
        specs.append(
            DeploymentSpec(
                name=name,
                snapshot_uri=uri,
                idle_timeout_s=settings.default_idle_timeout_s,
                **snapshot_serving_defaults(uri),  # the catalog's, as the API gives them
            )
        )
    try:
        run_server(settings, specs)
    except StartupError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--worker-id", required=True, help="Id the pool gave this worker.")
@click.option(
    "--control-plane",
    "control_plane",
    required=True,
    help="Control plane base URL to register with.",
)
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    help="Snapshot cache (default $HOTPOOL_HOME/cache).",
)
@click.option(
    "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address of the internal API.")
@click.option(
    "--port", type=int, default=0, show_default=True, help="Port of the internal API (0 = any)."
)
@click.option("--parent-pid", type=int, help="Exit when this process is no longer the parent.")
@click.option("--log-level", default="info", show_default=True)
def worker(
    worker_id: str,
    control_plane: str,
    cache_dir: Path | None,
    device: str,
    host: str,
    port: int,
    parent_pid: int | None,
    log_level: str,
) -> None:
    """Run one worker process (the pool starts these; the token comes in HOTPOOL_WORKER_TOKEN)."""
    from hotpool.worker.engine.llm_engine import EngineConfig
    from hotpool.worker.main import WorkerOptions, run_worker

    settings = _settings()
    if not settings.worker_token:
        raise click.ClickException("HOTPOOL_WORKER_TOKEN must be set for a worker")
    configure_logs(
        log_level,
        settings.log_format,
        fields={"worker_id": worker_id},
        text_format=f"%(asctime)s %(levelname)s {worker_id.replace('%', '%%')}: %(message)s",
    )
    run_worker(
        WorkerOptions(
            worker_id=worker_id,
            control_plane_url=control_plane,
            token=settings.worker_token,
            cache_dir=cache_dir or settings.cache_dir,
            device=device,
            host=host,
            port=port,
            parent_pid=parent_pid,
            log_level=log_level,
            snapshot_cache_bytes=settings.snapshot_cache_bytes,
            host_cache_bytes=settings.host_cache_bytes,
            engine=EngineConfig(
                kv_cache_bytes=settings.kv_cache_bytes,
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
            ),
        )
    )


@main.command()
@click.argument("name")
@click.option(
    "--snapshot", required=True, help="Snapshot URI, or a name in the local object store."
)
@click.option("--idle-timeout", type=float, help="Seconds without requests before scaling to zero.")
@click.option("--min-replicas", type=int, help="Default 0 for a new deployment.")
@click.option("--max-replicas", type=int, help="Default 1 for a new deployment.")
@click.option(
    "--quantization",
    type=click.Choice(["none", "int8", "gguf"]),
    help="How replicas hold the weights: none (in the activation dtype; a new deployment's"
    " default), int8 (weight-only, made at load) or gguf (the GGUF blocks the snapshot keeps).",
)
@click.option(
    "--speculative",
    metavar="METHOD[:K]|off|JSON",
    help="Speculative decoding: ngram (prompt lookup) or a JSON policy such as"
    ' \'{"method": "draft", "draft_snapshot": "smollm2", "num_tokens": 4}\'; K proposed'
    " tokens a step (default 4); off turns it off.",
)
@click.option(
    "--canary",
    type=click.FloatRange(0, 100),
    help="Percent of requests for this snapshot as a canary of existing deployment NAME"
    " (the stable version keeps the rest; `hotpool promote` or `hotpool rollback` ends it).",
)
@click.option("--url", help="hotpool API (default http://127.0.0.1:$HOTPOOL_PORT).")
def deploy(
    name: str,
    snapshot: str,
    idle_timeout: float | None,
    min_replicas: int | None,
    max_replicas: int | None,
    quantization: str | None,
    speculative: str | None,
    canary: float | None,
    url: str | None,
) -> None:
    """Create deployment NAME serving a snapshot, or give an existing one a new version:
    rolled out to all its traffic, or with --canary to a share of it."""
    base = f"{_api_url(url)}/v1/deployments"
    body: dict[str, Any] = {"snapshot_uri": _snapshot_uri(_settings(), snapshot)}
    for field, value in (("min_replicas", min_replicas), ("max_replicas", max_replicas),
                         ("idle_timeout_s", idle_timeout),
                         ("quantization", quantization)):  # fmt: skip
        if value is not None:
            body[field] = value
    if speculative is not None:
        body["speculative"] = _speculative(speculative)
    if canary is not None:
        out = _call("PATCH", f"{base}/{name}", json={**body, "canary": {"percent": canary}})
        click.echo(describe(out))
    elif (current := _call("GET", f"{base}/{name}", missing_ok=True)) is not None:
        out = _call("PATCH", f"{base}/{name}", json=body)
        if out["version"] == current["version"]:
            click.echo(f"{name} already serves {_served(out)} (version {out['version']})")
        else:
            click.echo(f"rolled out version {out['version']} of {name} from {_served(out)}")
    else:
        out = _call("POST", base, json={"name": name, **body})
        click.echo(f"deployed {out['name']} from {_served(out)}")


def _speculative(value: str) -> dict[str, Any] | None:
    """``--speculative``'s policy for the API (which checks it): ``off``, ``METHOD[:K]`` or
    a JSON object."""
    if value == "off":
        return None
    if value.lstrip().startswith("{"):
        try:
            policy = json.loads(value)
        except ValueError as exc:
            raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--speculative") from None
        return policy  # type: ignore[no-any-return]
    method, _, k = value.partition(":")
    if k and not k.isdigit():
        raise click.BadParameter(f"K must be a number, got {k!r}", param_hint="--speculative")
    return {"method": method, **({"num_tokens": int(k)} if k else {})}


def _served(deployment: dict[str, Any]) -> str:
    """Its snapshot, and its quantization and speculation unless none."""
    engine = deployment["engine"]
    extras = [] if engine["quantization"] == "none" else [f"{engine['quantization']} quantization"]
    spec = engine.get("speculative")
    if spec:
        extras.append(f"{spec['method']} speculation, k={spec['num_tokens']}")
    return deployment["snapshot_uri"] + (f" ({', '.join(extras)})" if extras else "")


@main.command()
@click.argument("name")
@click.argument("prompt")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.7, show_default=True)
@click.option("--raw", is_flag=True, help="Plain completion (no chat template).")
@click.option("--url", help="hotpool API (default http://127.0.0.1:$HOTPOOL_PORT).")
def invoke(
    name: str, prompt: str, max_tokens: int, temperature: float, raw: bool, url: str | None
) -> None:
    """Send PROMPT to deployment NAME and print the answer and its usage."""
    body: dict[str, Any] = {"model": name, "max_tokens": max_tokens, "temperature": temperature}
    if raw:
        out = _call("POST", f"{_api_url(url)}/v1/completions", json={**body, "prompt": prompt})
        text = out["choices"][0]["text"]
    else:
        messages = [{"role": "user", "content": prompt}]
        out = _call(
            "POST", f"{_api_url(url)}/v1/chat/completions", json={**body, "messages": messages}
        )
        text = out["choices"][0]["message"]["content"]
    click.echo(text)
    u = out["usage"]
    click.echo(
        f"[{u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens]", err=True
    )


@main.command()
@click.option(
    "--bucket-width", type=click.Choice(["1m", "1h", "1d"]), default="1d", show_default=True
)
@click.option(
    "--limit", type=int, help="Number of buckets (default 7 days, 24 hours or 60 minutes)."
)
@click.option(
    "--group-by",
    "group_by",
    type=click.Choice(["deployment", "api_key"]),
    multiple=True,
    help="Split each bucket by deployment and/or API key (repeatable; default deployment).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON of GET /v1/usage.")
@click.option("--url", help="hotpool API (default http://127.0.0.1:$HOTPOOL_PORT).")
def usage(
    bucket_width: str,
    limit: int | None,
    group_by: tuple[str, ...],
    as_json: bool,
    url: str | None,
) -> None:
    """Token usage per deployment over time, with its cost."""
    groups = list(dict.fromkeys(group_by or ("deployment",)))
    params: dict[str, Any] = {"bucket_width": bucket_width, "group_by": ",".join(groups)}
    if limit:
        params["limit"] = limit
    out = _call("GET", f"{_api_url(url)}/v1/usage", params=params)
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    fmt = "%Y-%m-%d %H:%M" if bucket_width != "1d" else "%Y-%m-%d"
    header = ["BUCKET (UTC)"]
    header += [{"deployment": "DEPLOYMENT", "api_key": "API KEY"}[g] for g in groups]
    header += ["REQUESTS", "INPUT", "CACHED", "OUTPUT", "COST"]
    rows = []
    for bucket in out["data"]:
        when = time.strftime(fmt, time.gmtime(bucket["start_time"]))
        for r in bucket["results"]:
            keys = [r["model"] if g == "deployment" else r["api_key_id"] for g in groups]
            cost = r.get("cost")
            rows.append(
                [
                    when,
                    *(k if k is not None else "-" for k in keys),
                    *(str(r[f]) for f in _USAGE_COUNTS),
                    f"{cost['value']} {cost['currency']}" if cost else "-",
                ]
            )
    print_table(header, rows, numeric_from=1 + len(groups))


_USAGE_COUNTS = ("num_model_requests", "input_tokens", "input_cached_tokens", "output_tokens")


@main.group()
def db() -> None:
    """Ledger database schema (Alembic migrations)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Migrate the database at HOTPOOL_DATABASE_URL to REVISION."""
    from alembic.util.exc import CommandError

    from hotpool.billing.db import Database, DatabaseUnavailable, explained

    url = _settings().database_url
    try:
        with explained(url):
            database = Database(url)
            database.upgrade(revision)
            click.echo(f"database at revision {database.current_revision()}")
    except DatabaseUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    except CommandError as exc:  # an unknown revision
        raise click.ClickException(f"cannot upgrade to {revision!r}: {exc}") from None


@db.command("current")
def db_current() -> None:
    """Print the database's current revision."""
    from hotpool.billing.db import Database, DatabaseUnavailable, explained

    url = _settings().database_url
    try:
        with explained(url):
            click.echo(Database(url).current_revision() or "(empty)")
    except DatabaseUnavailable as exc:
        raise click.ClickException(str(exc)) from None


# Registered last: the snapshot commands live in their own module.
main.add_command(models)
main.add_command(snapshot)
main.add_command(tenants)
main.add_command(keys)
main.add_command(prices)
main.add_command(ledger)
main.add_command(promote)
main.add_command(rollback)
main.add_command(versions)
main.add_command(plan)
