"""Helpers every CLI module shares."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click
import httpx

from hotpool.settings import Settings, SettingsError, load_settings
from hotpool.snapshot_names import SnapshotNameError, resolve_snapshot

if TYPE_CHECKING:
    from hotpool.billing.db import Database


def settings_or_exit() -> Settings:
    try:
        return load_settings()
    except SettingsError as exc:
        click.echo(f"hotpool: {exc}", err=True)
        sys.exit(2)


def snapshot_uri(settings: Settings, value: str) -> str:
    """A full URI as given; a bare name means a snapshot in the local object store (as the
    API reads it too: :mod:`hotpool.snapshot_names`)."""
    try:
        return resolve_snapshot(value, settings.snapshots_dir)
    except SnapshotNameError as exc:
        raise click.UsageError(str(exc)) from None


@contextlib.contextmanager
def database() -> Iterator[Database]:
    """The ledger of the current settings with a current schema (SQLite is migrated on the
    spot, as `hotpool serve` does), or a one-line error."""
    from sqlalchemy.exc import OperationalError

    from hotpool.billing.db import (
        Database,
        DatabaseUnavailable,
        StaleSchema,
        explained,
        unreachable,
    )

    url = settings_or_exit().database_url
    try:
        with explained(url):
            db = Database(url)
    except DatabaseUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    try:
        with explained(url):  # where a URL, a driver or a server fails
            db.ensure_schema()
        yield db  # the command's own errors stay its own, but for losing the server
    except (StaleSchema, DatabaseUnavailable) as exc:
        raise click.ClickException(str(exc)) from None
    except OperationalError as exc:
        raise click.ClickException(str(unreachable(exc, url))) from None
    finally:
        db.dispose()


def print_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int | None = None
) -> None:
    """Columns as wide as their widest cell; from column ``numeric_from`` on, right-aligned."""
    table = [list(header), *(list(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    right = len(header) if numeric_from is None else numeric_from
    for row in table:
        cells = [
            cell.rjust(w) if i >= right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        click.echo("  ".join(cells).rstrip())


EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 1, 1, tzinfo=UTC)  # a margin under datetime.max: hours get added


def utc_time(value: str | None, option: str) -> datetime | None:
    """An ISO 8601 option value; without an offset it is taken as UTC."""
    if value is None:
        return None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not an ISO 8601 time such as 2025-04-01 or 2025-04-01T12:00+02:00",
            param_hint=option,
        ) from None
    at = at.replace(tzinfo=UTC) if at.tzinfo is None else at
    try:
        inside = EARLIEST <= at < LATEST
    except OverflowError:  # 0001-01-01T00:00+01:00 is before year 1 in UTC
        inside = False
    if not inside:
        raise click.BadParameter(
            f"{value!r} is outside the times hotpool keeps (1970 to 9998)", param_hint=option
        )
    return at


def api_url(url: str | None) -> str:
    """The hotpool API's base URL: ``url``, or this machine's server."""
    if url:
        return url.rstrip("/")
    return f"http://127.0.0.1:{settings_or_exit().port}"


API_KEY_VAR = "HOTPOOL_API_KEY"  # the key the CLI sends to a server that requires keys


def call_api(method: str, url: str, missing_ok: bool = False, **kwargs: Any) -> Any:
    """One API call; its JSON answer, or a ClickException with the API's error message
    (``missing_ok``: None for a 404). With ``HOTPOOL_API_KEY`` set, the call carries it."""
    key = os.environ.get(API_KEY_VAR, "").strip()
    if key:
        kwargs["headers"] = {"authorization": f"Bearer {key}", **kwargs.get("headers", {})}
    try:
        r = httpx.request(method, url, timeout=httpx.Timeout(600.0, connect=5.0), **kwargs)
    except (httpx.ConnectError, httpx.ConnectTimeout):
        raise click.ClickException(
            f"cannot reach hotpool at {url}; is `hotpool serve` running?"
        ) from None
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise click.ClickException(f"invalid hotpool URL {url}: {exc}") from None
    if r.status_code == 404 and missing_ok:
        return None
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        if r.status_code == 401 and not key:
            message += f" (set {API_KEY_VAR} to the key the CLI should send)"
        raise click.ClickException(f"{r.status_code}: {message}")
    return r.json()
