"""Validate deployment bodies: the whole spec on create, a subset of fields on update.

Each field has one parser, used by both, so ``POST`` and ``PATCH`` accept exactly the same
values and answer with the same 400 naming the field. A bare snapshot name is resolved in the
local object store first, as the CLI resolves it (:mod:`hotpool.snapshot_names`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hotpool.billing.deployments import (
    MAX_KV_CACHE_BYTES,
    MIN_KV_CACHE_BYTES,
    REPLICA_FIELDS,
    DeploymentSpec,
)
from hotpool.billing.models import QUANTIZATIONS
from hotpool.platform.errors import APIError, invalid, json_object
from hotpool.snapshot_names import SnapshotNameError, is_bare_name, resolve_snapshot
from hotpool.worker.protocol import RUNNABLE_MODEL_TYPES, SpeculativeConfig

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
# S3's bucket naming rule (what MinIO and other S3-compatible stores hold to as well), and a
# key prefix the workers can list: no query, fragment or control characters.
# (Legacy buckets, which S3 still serves, may hold capitals and '_', and be 255 long.)
S3_URI = re.compile(r"s3://[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9](/[^?#\x00-\x1f\x7f]*)?")
DTYPES = ("bf16", "fp16", "fp32")
MAX_IDLE_TIMEOUT_S = 7 * 86400
MAX_QUEUE_TIMEOUT_S = 3600
# What the SQL columns hold (INTEGER is 32 bits in PostgreSQL; kv_cache_bytes, a BIGINT, has
# a lower bound of its own): a larger value must be a 400 here, not an overflow in the database.
MAX_INT = (1 << 31) - 1


def _snapshot_uri(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("file:///", "s3://")):
        raise invalid(
            "`snapshot_uri` must be a file:///absolute/path or s3://bucket/prefix URI, or the "
            "name of a snapshot in the local object store",
            "snapshot_uri",
        )
    uri = value.rstrip("/")
    if value.startswith("file://"):
        _check_local_snapshot(value)
    elif not S3_URI.fullmatch(uri):
        # Checked now: a URI no worker can fetch would otherwise be stored, and fail every
        # cold start of the deployment with a 503.
        raise invalid(
            f"`snapshot_uri` {uri!r} is not an s3://bucket/prefix URI: the bucket must be 3-255 "
            "characters of letters, digits, '.', '_' and '-', starting and ending with a "
            "letter or digit, and the prefix must not hold '?', '#' or control characters",
            "snapshot_uri",
        )
    return uri


def _int(
    name: str, minimum: int, nullable: bool = False, maximum: int = MAX_INT
) -> Callable[[Any], int | None]:
    def parse(value: Any) -> int | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise invalid(f"`{name}` must be an integer >= {minimum}", name)
        if value > maximum:
            raise invalid(f"`{name}` must be at most {maximum}", name)
        return value

    return parse


def _seconds(name: str, maximum: float, nullable: bool = False) -> Callable[[Any], float | None]:
    def parse(value: Any) -> float | None:
        if value is None and nullable:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            # NaN and inf fail this too; math.isfinite() would overflow on a huge int
            or not 0 < value <= maximum
        ):
            raise invalid(f"`{name}` must be a number of seconds in (0, {maximum:g}]", name)
        return float(value)

    return parse


def _dtype(value: Any) -> str | None:
    if value is None or value in DTYPES:
        return value  # type: ignore[no-any-return]
    raise invalid(f"`dtype` must be one of {', '.join(DTYPES)} (or null: the snapshot's)", "dtype")


def _quantization(value: Any) -> str:
    if value is None:  # null resets it to the default, as for the other options
        return "none"
    if value in QUANTIZATIONS:
        return value  # type: ignore[no-any-return]
    raise invalid(
        f"`quantization` must be one of {', '.join(QUANTIZATIONS)} (none: weights in the "
        "activation dtype; int8: weight-only int8 made at load; gguf: the snapshot's GGUF blocks)",
        "quantization",
    )


# Every field a user may set, with its parser; `name` is set once, on create.
PARSERS: dict[str, Callable[[Any], Any]] = {
    "snapshot_uri": _snapshot_uri,
    "min_replicas": _int("min_replicas", 0),
    "max_replicas": _int("max_replicas", 1),
    "target_concurrency": _int("target_concurrency", 1),
    "idle_timeout_s": _seconds("idle_timeout_s", MAX_IDLE_TIMEOUT_S),
    "max_queue": _int("max_queue", 1, nullable=True),
    "queue_timeout_s": _seconds("queue_timeout_s", MAX_QUEUE_TIMEOUT_S, nullable=True),
    "dtype": _dtype,
    "quantization": _quantization,
    # Checked with the local object store at hand (a draft model's name resolves there):
    # ``_with_speculative`` does it once the body's other fields are parsed.
    "speculative": lambda value: value,
    "max_model_len": _int("max_model_len", 16, nullable=True),
    "kv_cache_bytes": _int(
        "kv_cache_bytes", MIN_KV_CACHE_BYTES, nullable=True, maximum=MAX_KV_CACHE_BYTES
    ),
    "default_max_tokens": _int("default_max_tokens", 1, nullable=True),
    "max_tokens_limit": _int("max_tokens_limit", 1, nullable=True),
}


def parse_deployment(
    body: Any, default_idle_timeout_s: float, snapshots_dir: Path
) -> DeploymentSpec:
    """A new deployment from a ``POST /v1/deployments`` body; a bare snapshot name means the
    snapshot of that name in ``snapshots_dir``, the local object store's."""
    body = json_object(body, {"name", *PARSERS})
    name = body.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):  # match() takes "name\n"
        raise invalid(
            "`name` must be 1-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit",
            "name",
        )
    if "snapshot_uri" not in body:
        raise invalid("`snapshot_uri` is required", "snapshot_uri")
    body = _named_snapshot_resolved(body, snapshots_dir)
    body = {**snapshot_serving_defaults(body["snapshot_uri"]), **body}
    values = {field: PARSERS[field](value) for field, value in body.items() if field != "name"}
    values = _with_speculative(values, snapshots_dir)
    values.setdefault("idle_timeout_s", default_idle_timeout_s)
    spec = _spec(DeploymentSpec, {"name": name, **values})
    _check_gguf_blocks(spec)
    return spec


@dataclass(frozen=True)
class CanaryChange:
    """The ``canary`` of a ``PATCH``: ``version`` None with ``percent`` means "the new
    version this PATCH makes"; ``clear`` ends the canary."""

    version: int | None = None
    percent: float | None = None
    clear: bool = False


@dataclass(frozen=True)
class Update:
    changes: dict[str, Any]  # spec fields
    canary: CanaryChange | None = None


def parse_update(body: Any, current: DeploymentSpec, snapshots_dir: Path) -> Update:
    """The changes of a ``PATCH`` body, checked against ``current`` as a whole (``name``
    cannot change; ``null`` resets an optional field to the server's default; a bare snapshot
    name is looked up in ``snapshots_dir``, as on create).

    ``canary``: ``{"version": N, "percent": P}`` sends P% of requests to existing version N;
    ``{"percent": P}`` with new snapshot or engine options makes them a new canary version
    (instead of rolling them out to everyone); ``null`` ends the canary."""
    body = json_object(body, {"name", "canary", *PARSERS})
    if "name" in body and body["name"] != current.name:
        raise invalid("a deployment cannot be renamed; create a new one", "name")
    body = _named_snapshot_resolved(body, snapshots_dir)
    changes = {f: PARSERS[f](v) for f, v in body.items() if f not in ("name", "canary")}
    changes = _with_speculative(changes, snapshots_dir)
    canary = _canary(body["canary"], changes) if "canary" in body else None
    if not changes and canary is None:
        settable = ", ".join(sorted([*PARSERS, "canary"]))
        raise invalid(f"nothing to change; settable fields: {settable}")
    new = _spec(lambda **kw: replace(current, **kw), changes, current)
    if {"snapshot_uri", "quantization"} & set(changes):
        _check_gguf_blocks(new)
    return Update(changes, canary)


def _canary(value: Any, changes: dict[str, Any]) -> CanaryChange:
    if value is None:
        return CanaryChange(clear=True)
    if not isinstance(value, dict):
        raise invalid("`canary` must be an object {version, percent} or null", "canary")
    unknown = sorted(set(value) - {"version", "percent"})
    if unknown:
        raise invalid(f"`canary` takes `version` and `percent`, not `{unknown[0]}`", "canary")
    percent = value.get("percent")
    if (
        isinstance(percent, bool)
        or not isinstance(percent, int | float)
        or not 0 <= percent <= 100  # NaN fails too
    ):
        raise invalid("`canary.percent` must be a number from 0 to 100", "canary.percent")
    version = value.get("version")
    new = {f for f in changes if f in REPLICA_FIELDS}
    if version is None:
        if not new:
            raise invalid(
                "`canary` needs a `version`, or a new `snapshot_uri` or engine option in the"
                " same request to make one",
                "canary.version",
            )
    else:
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_INT:
            raise invalid("`canary.version` must be a version number (an integer >= 1)",
                          "canary.version")  # fmt: skip
        if new:
            raise invalid(
                "give either `canary.version` (an existing version) or new settings for a"
                f" new one, not both ({', '.join(sorted(new))})",
                "canary.version",
            )
    return CanaryChange(version, float(percent))


def _spec(
    make: Callable[..., DeploymentSpec],
    values: dict[str, Any],
    current: DeploymentSpec | None = None,
) -> DeploymentSpec:
    low = values.get("min_replicas", current.min_replicas if current else 0)
    high = values.get("max_replicas", current.max_replicas if current else 1)
    if low > high:
        raise invalid("`min_replicas` must not exceed `max_replicas`", "min_replicas")
    try:
        return make(**values)
    except ValueError as exc:  # any other rule across fields
        message = str(exc)
        param = next((f for f in PARSERS if message.startswith(f)), None)
        raise invalid(message, param) from None


def _named_snapshot_resolved(body: dict[str, Any], snapshots_dir: Path) -> dict[str, Any]:
    """``body`` with a bare ``snapshot_uri`` (``"smollm2"``) replaced by the URI of that
    snapshot in the local object store, so the deployment stores the URI its workers fetch.
    A name that is not there is a 400 naming the store (a URI is checked by its parser)."""
    name = body.get("snapshot_uri")
    if not isinstance(name, str) or not is_bare_name(name):
        return body
    return {**body, "snapshot_uri": _resolved_name(name, snapshots_dir, "snapshot_uri")}


def _resolved_name(name: str, snapshots_dir: Path, param: str) -> str:
    """The URI of snapshot ``name`` in the local object store; a 400 naming ``param`` and
    the store when it is not there."""
    try:
        uri = resolve_snapshot(name, snapshots_dir)
    except SnapshotNameError as exc:
        raise invalid(f"`{param}` {exc}", param) from None
    try:
        found = (Path(uri.removeprefix("file://")) / "manifest.json").is_file()
    except OSError:  # a name too long for the file system
        found = False
    if not found:
        raise invalid(
            f"`{param}` {_shown(name)!r} names no snapshot in the local object store "
            f"(file://{snapshots_dir}): put one there with `hotpool models pull` or "
            "`hotpool snapshot push SRC NAME`, or give a file:///absolute/path or "
            "s3://bucket/prefix URI",
            param,
            code="snapshot_not_found",
        )
    return uri


def _with_speculative(values: dict[str, Any], snapshots_dir: Path) -> dict[str, Any]:
    """``values`` with ``speculative`` (when given) checked and stored as canonical JSON
    text: the policy with every default filled in, a draft model's bare name resolved in
    the local object store, a local draft snapshot checked as ``snapshot_uri`` is. ``null``
    turns speculation off."""
    if "speculative" not in values or values["speculative"] is None:
        return values
    try:
        config = SpeculativeConfig.from_json(values["speculative"])
    except ValueError as exc:
        raise invalid(str(exc), "speculative") from None
    draft = config.draft_snapshot
    if draft is not None:
        param = "speculative.draft_snapshot"
        if is_bare_name(draft):
            draft = _resolved_name(draft, snapshots_dir, param)
        elif draft.startswith("file:///"):
            try:
                _check_local_snapshot(draft)
            except APIError as exc:
                raise APIError(exc.status, f"`{param}`: {exc.message}", param=param) from None
        elif not draft.startswith("s3://") or not S3_URI.fullmatch(draft.rstrip("/")):
            raise invalid(
                f"`{param}` must be a file:///absolute/path or s3://bucket/prefix URI, or the "
                "name of a snapshot in the local object store",
                param,
            )
        config = replace(config, draft_snapshot=draft.rstrip("/"))
    text = json.dumps(config.to_json(), sort_keys=True, separators=(",", ":"))
    return {**values, "speculative": text}


def snapshot_serving_defaults(uri: Any) -> dict[str, Any]:
    """The settings a local snapshot's manifest gives its deployments by default (a catalog
    model's ``serving``: ``hotpool models pull`` writes them), for what a request leaves out;
    nothing for an s3:// snapshot (not read here) or one without them."""
    if not isinstance(uri, str) or not uri.startswith("file:///"):
        return {}
    serving = _check_local_snapshot(uri).get("serving")
    if not isinstance(serving, dict):
        return {}
    return {k: v for k, v in serving.items() if k in SERVING_DEFAULTS}


# What a snapshot's manifest may set by default (the answer bounds and the weights' form).
SERVING_DEFAULTS = frozenset({"quantization", "default_max_tokens", "max_tokens_limit"})


def _check_local_snapshot(uri: str) -> dict[str, Any]:
    """A local snapshot is checked now (an s3:// one when its first replica loads it): it
    must exist, have a manifest, and hold a model type the workers run; its manifest is
    returned. (The worker verifies the manifest in full when it loads the snapshot.)"""
    path = Path(uri.removeprefix("file://")) / "manifest.json"
    try:
        found = path.is_file()
    except OSError as exc:  # a name too long for the file system, a folder it may not read
        raise APIError(
            422, f"no snapshot at {_shown(uri)} ({exc.strerror})", param="snapshot_uri"
        ) from None
    if not found:
        raise APIError(
            422, f"no snapshot at {_shown(uri)} (manifest.json not found)", param="snapshot_uri"
        )
    try:
        manifest = json.loads(path.read_text())
        architecture = manifest["architecture"]
    except (OSError, ValueError, KeyError, TypeError):
        raise APIError(
            422, f"snapshot at {uri} has an unreadable manifest.json", param="snapshot_uri"
        ) from None
    if architecture not in RUNNABLE_MODEL_TYPES:
        raise APIError(
            422,
            f"snapshot at {uri} holds a {architecture!r} model; hotpool runs "
            f"{', '.join(RUNNABLE_MODEL_TYPES)}",
            param="snapshot_uri",
        )
    return manifest  # type: ignore[no-any-return]


def _check_gguf_blocks(spec: DeploymentSpec) -> None:
    """``quantization: gguf`` serves the GGUF blocks a snapshot keeps (its manifest lists their
    types under ``quantized``): a local snapshot without them is refused now. An s3:// one is
    not read here; its first load fails with the same reason."""
    if spec.quantization != "gguf" or not spec.snapshot_uri.startswith("file://"):
        return
    quantized = _check_local_snapshot(spec.snapshot_uri).get("quantized")
    if not isinstance(quantized, list) or not quantized:
        raise invalid(
            f"snapshot {_shown(spec.snapshot_uri)} keeps no GGUF blocks (its manifest lists no "
            "`quantized` block types), which `quantization: gguf` serves: convert it from a "
            "GGUF keeping them (`hotpool models pull --gguf-blocks`), or use int8 or none",
            "quantization",
        )


def _shown(uri: str) -> str:
    return uri if len(uri) <= 200 else f"{uri[:200]}... ({len(uri)} characters)"
