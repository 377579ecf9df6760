"""Settings from ``HOTPOOL_*`` environment variables, read and validated once at start-up.

A bad value raises :class:`SettingsError` whose message is one line naming the setting, so
``hotpool serve`` can print it and exit instead of failing later with a traceback.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

LOG_LEVELS = ("debug", "info", "warning", "error")
AUTH_MODES = ("auto", "keys", "none")
ROUTING_MODES = ("cache_aware", "least_loaded")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("local", "ray")


class SettingsError(ValueError):
    """A ``HOTPOOL_*`` setting has a value hotpool cannot use."""


@dataclass(frozen=True)
class Settings:
    """Everything the control plane and its local worker pool need to start.

    The data dir (``HOTPOOL_HOME``) holds the embedded defaults: the SQLite ledger, the
    ``file://`` object store and the workers' snapshot cache.
    """

    home: Path
    database_url: str
    object_store_url: str
    cache_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    max_workers: int = 2
    warm_workers: int = 1  # idle workers (no model) kept ready, within max_workers; 0 = off
    worker_start_timeout_s: float = 120.0
    heartbeat_timeout_s: float = 15.0  # a worker silent this long is dead (it beats every 2s)
    scale_down_window_s: float = 30.0  # scale down to the highest need seen over this window
    # Seconds of measured work (prompt and expected output tokens) a replica may hold
    # before the autoscaler adds another.
    scale_backlog_s: float = 10.0
    preempt_after_s: float = 10.0  # a deployment waiting this long for a worker takes a busy one
    worker_threads: int | None = None  # CPU threads per worker; None: cores / max_workers
    default_idle_timeout_s: float = 300.0
    queue_timeout_s: float = 300.0
    max_queue: int = 256
    # How the router picks among a deployment's ready replicas: where the prompt's prefix is
    # cached (weighed against load), or the least loaded.
    routing: str = "cache_aware"
    log_level: str = "info"
    log_format: str = "text"  # text or json (one object per line)
    # 0: prompts and outputs never reach the log; N: at debug level, each request's prompt
    # and output are logged, each cut to N characters.
    log_prompts: int = 0
    auth: str = "auto"  # keys: API keys required; none: local-only; auto: none on loopback
    # A key check that the database does not answer within this is given up on (a frozen
    # database must not hang every request)...
    auth_timeout_s: float = 2.0
    # ...and a key checked within this many seconds is honoured while the database cannot
    # answer (revoked ones stay refused as last seen); any other key is then a 503.
    auth_grace_s: float = 300.0
    # A client's request head must arrive within this of its first byte, and its body may
    # not pause longer than this between reads, or it gets a 408 (nginx's defaults: 60 s).
    head_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    kv_cache_bytes: int = 1 << 30  # per worker
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    snapshot_cache_bytes: int = 20 << 30  # per worker cache dir; LRU eviction above it
    host_cache_bytes: int = 4 << 30  # per worker: unloaded models kept in RAM (0 = off)
    s3_endpoint_url: str | None = None  # None: AWS S3 itself (MinIO, R2: their URL)
    spool_dir: Path | None = None  # usage spool + in-flight journal; None: <home>/spool
    inflight_every_tokens: int = 16  # journal a running request's tokens at most this often
    worker_token: str | None = field(default=None, repr=False)
    backend: str = "local"  # where workers run: local processes or a Ray cluster
    ray_address: str | None = None  # Ray cluster to join; None: start a private local one
    ray_worker_cpus: float = 1.0  # CPUs each Ray worker actor holds (besides its GPU, if any)
    control_plane_url: str | None = None  # how workers reach us; None: from host and port

    @property
    def auth_enabled(self) -> bool:
        """Whether requests need an API key: always, unless ``none`` or ``auto`` on loopback."""
        if self.auth == "auto":
            return self.host not in LOOPBACK_HOSTS
        return self.auth == "keys"

    @property
    def ledger_spool_dir(self) -> Path:
        """Where usage the database could not take, and the in-flight journal, are kept."""
        return self.spool_dir or self.home / "spool"

    @property
    def snapshots_dir(self) -> Path:
        """Where the embedded ``file://`` object store keeps snapshots."""
        return Path(self.object_store_url.removeprefix("file://")) / "snapshots"


def _parse(env: Mapping[str, str], name: str, default: T, conv: Callable[[str], T]) -> T:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return conv(raw)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{name}={raw!r} is invalid: {exc}") from None


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be an integer >= 1")
    return value


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be an integer >= 0")
    return value


def _off_or_positive_int(raw: str) -> int:
    """``off`` or ``0`` (0), or an integer >= 1."""
    text = raw.strip().lower()
    if text in ("off", "0"):
        return 0
    try:
        return _positive_int(text)
    except ValueError:
        raise ValueError("must be off (or 0), or an integer >= 1") from None


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError("must be a finite number > 0")
    return value


def _non_negative_float(raw: str) -> float:
    value = float(raw)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError("must be a finite number >= 0")
    return value


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _byte_size(raw: str) -> int:
    """``1073741824``, ``512m``, ``2g`` or ``2GiB``."""
    text = raw.strip().lower().removesuffix("ib").removesuffix("b")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    value = int(float(text[: len(text) - len(unit)]) * _UNITS[unit])
    if value < 1 << 20:
        raise ValueError("must be at least 1m (bytes, or with a k/m/g suffix)")
    return value


def _byte_size_or_off(raw: str) -> int:
    """A byte size as :func:`_byte_size` reads it, or ``0``: the feature is off."""
    if raw.strip() == "0":
        return 0
    try:
        return _byte_size(raw)
    except ValueError:
        raise ValueError("must be 0 (off) or at least 1m (bytes, or with a k/m/g suffix)") from None


def _port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port between 0 and 65535")
    return value


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def conv(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return conv


def _store_url(raw: str) -> str:
    if raw.startswith("file://"):
        return raw.rstrip("/")
    if raw.startswith("/"):
        return "file://" + raw.rstrip("/")
    raise ValueError(
        "must be a file:// URL or an absolute path (deployments name s3:// snapshots by URI)"
    )


def _endpoint_url(raw: str) -> str:
    value = raw.strip().rstrip("/")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("must be an http:// or https:// URL such as http://127.0.0.1:9000")
    return value


def _ray_address(raw: str) -> str:
    """``auto``, ``host:port`` (the head's GCS) or ``ray://host:port`` (Ray Client)."""
    value = raw.strip()
    if value == "auto":
        return value
    rest = value.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or "/" in rest or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("must be auto, host:port or ray://host:port (e.g. ray://head:10001)")
    return value


S3_ENDPOINT_VARS = ("HOTPOOL_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def s3_endpoint_url(env: Mapping[str, str] | None = None) -> str | None:
    """The S3 endpoint to use: ``HOTPOOL_S3_ENDPOINT_URL``, else the AWS SDKs' own
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, else None (AWS S3 itself).

    Public so the worker's object store resolves the endpoint exactly as start-up validated it.
    """
    env = os.environ if env is None else env
    for name in S3_ENDPOINT_VARS:
        value = _parse(env, name, None, _endpoint_url)
        if value is not None:
            return value
    return None


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read every ``HOTPOOL_*`` setting from ``env`` (default: the process environment)."""
    env = os.environ if env is None else env
    settings = _load(env)
    if settings.ray_address is not None and settings.backend != "ray":
        # Silently ignoring it would run workers on this machine instead of the cluster.
        raise SettingsError(
            f"HOTPOOL_RAY_ADDRESS={settings.ray_address!r} is set but HOTPOOL_BACKEND is "
            f"{settings.backend!r}: set HOTPOOL_BACKEND=ray to use the Ray cluster"
        )
    return settings


def _load(env: Mapping[str, str]) -> Settings:
    home = _parse(env, "HOTPOOL_HOME", Path("~/.hotpool"), Path).expanduser().resolve()
    return Settings(
        home=home,
        database_url=_parse(env, "HOTPOOL_DATABASE_URL", f"sqlite:///{home / 'hotpool.db'}", str),
        object_store_url=_parse(
            env, "HOTPOOL_OBJECT_STORE", f"file://{home / 'objects'}", _store_url
        ),
        cache_dir=_parse(env, "HOTPOOL_CACHE_DIR", home / "cache", Path).expanduser().resolve(),
        host=_parse(env, "HOTPOOL_HOST", "127.0.0.1", str),
        port=_parse(env, "HOTPOOL_PORT", 8000, _port),
        device=_parse(env, "HOTPOOL_DEVICE", "auto", _one_of(DEVICES)),
        max_workers=_parse(env, "HOTPOOL_MAX_WORKERS", 2, _positive_int),
        warm_workers=_parse(env, "HOTPOOL_WARM_WORKERS", 1, _non_negative_int),
        worker_start_timeout_s=_parse(
            env, "HOTPOOL_WORKER_START_TIMEOUT_S", 120.0, _positive_float
        ),
        heartbeat_timeout_s=_parse(env, "HOTPOOL_HEARTBEAT_TIMEOUT_S", 15.0, _positive_float),
        scale_down_window_s=_parse(env, "HOTPOOL_SCALE_DOWN_WINDOW_S", 30.0, _non_negative_float),
        scale_backlog_s=_parse(env, "HOTPOOL_SCALE_BACKLOG_S", 10.0, _positive_float),
        preempt_after_s=_parse(env, "HOTPOOL_PREEMPT_AFTER_S", 10.0, _non_negative_float),
        worker_threads=_parse(env, "HOTPOOL_WORKER_THREADS", None, _positive_int),
        default_idle_timeout_s=_parse(env, "HOTPOOL_IDLE_TIMEOUT_S", 300.0, _positive_float),
        queue_timeout_s=_parse(env, "HOTPOOL_QUEUE_TIMEOUT_S", 300.0, _positive_float),
        max_queue=_parse(env, "HOTPOOL_MAX_QUEUE", 256, _positive_int),
        routing=_parse(env, "HOTPOOL_ROUTING", "cache_aware", _one_of(ROUTING_MODES)),
        log_level=_parse(env, "HOTPOOL_LOG_LEVEL", "info", _one_of(LOG_LEVELS)),
        log_format=_parse(env, "HOTPOOL_LOG_FORMAT", "text", _one_of(("text", "json"))),
        log_prompts=_parse(env, "HOTPOOL_LOG_PROMPTS", 0, _off_or_positive_int),
        auth=_parse(env, "HOTPOOL_AUTH", "auto", _one_of(AUTH_MODES)),
        auth_timeout_s=_parse(env, "HOTPOOL_AUTH_TIMEOUT_S", 2.0, _positive_float),
        auth_grace_s=_parse(env, "HOTPOOL_AUTH_GRACE_S", 300.0, _non_negative_float),
        head_timeout_s=_parse(env, "HOTPOOL_HEAD_TIMEOUT_S", 30.0, _positive_float),
        body_timeout_s=_parse(env, "HOTPOOL_BODY_TIMEOUT_S", 60.0, _positive_float),
        kv_cache_bytes=_parse(env, "HOTPOOL_KV_CACHE_BYTES", 1 << 30, _byte_size),
        max_num_seqs=_parse(env, "HOTPOOL_MAX_NUM_SEQS", 64, _positive_int),
        max_num_batched_tokens=_parse(env, "HOTPOOL_MAX_NUM_BATCHED_TOKENS", 2048, _positive_int),
        snapshot_cache_bytes=_parse(env, "HOTPOOL_SNAPSHOT_CACHE_BYTES", 20 << 30, _byte_size),
        host_cache_bytes=_parse(env, "HOTPOOL_HOST_CACHE_BYTES", 4 << 30, _byte_size_or_off),
        s3_endpoint_url=s3_endpoint_url(env),
        spool_dir=_parse(env, "HOTPOOL_SPOOL_DIR", home / "spool", Path).expanduser().resolve(),
        inflight_every_tokens=_parse(env, "HOTPOOL_INFLIGHT_EVERY_TOKENS", 16, _positive_int),
        worker_token=env.get("HOTPOOL_WORKER_TOKEN") or None,
        backend=_parse(env, "HOTPOOL_BACKEND", "local", _one_of(BACKENDS)),
        ray_address=_parse(env, "HOTPOOL_RAY_ADDRESS", None, _ray_address),
        ray_worker_cpus=_parse(env, "HOTPOOL_RAY_WORKER_CPUS", 1.0, _positive_float),
        control_plane_url=_parse(env, "HOTPOOL_CONTROL_PLANE_URL", None, _endpoint_url),
    )
