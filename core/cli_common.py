"""Helpers every CLI module shares."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click
import httpx

from hotpool.settings import Settings, SettingsError, load_settings

if TYPE_CHECKING:
    from hotpool.billing.db import Database


def settings_or_exit() -> Settings:
    try:
        return load_settings()
    except SettingsError as exc:
        click.echo(f"hotpool: {exc}", err=True)
        sys.exit(2)


def snapshot_uri(settings: Settings, value: str) -> str:
    """A full URI as given; a bare name means a snapshot in the local object store."""
    if "://" in value:
        return value
    return f"file://{settings.snapshots_dir / value}"


@contextlib.contextmanager
def database() -> Iterator[Database]:
    """The ledger of the current settings with a current schema (SQLite is migrated on the
    spot, as `hotpool serve` does), or a one-line error."""
    from sqlalchemy.exc import OperationalError

    from hotpool.billing.db import Database, StaleSchema

    db = Database(settings_or_exit().database_url)
    try:
        db.ensure_schema()
        yield db
    except StaleSchema as exc:
        raise click.ClickException(str(exc)) from None
    except OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise click.ClickException(f"cannot use the database {db!r}: {reason}") from None
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
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at


def api_url(url: str | None) -> str:
    """The hotpool API's base URL: ``url``, or this machine's server."""
    if url:
        return url.rstrip("/")
    return f"http://127.0.0.1:{settings_or_exit().port}"


def call_api(method: str, url: str, missing_ok: bool = False, **kwargs: Any) -> Any:
    """One API call; its JSON answer, or a ClickException with the API's error message
    (``missing_ok``: None for a 404)."""
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
        raise click.ClickException(f"{r.status_code}: {message}")
    return r.json()
