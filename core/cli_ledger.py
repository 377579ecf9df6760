"""`hotpool ledger`: upkeep of the usage ledger, straight in the database.

Like `hotpool keys`, these commands use the database of the current settings, not a running
server.
"""

from __future__ import annotations

import click

from hotpool.cli_common import database, utc_time


@click.group()
def ledger() -> None:
    """The usage ledger's hourly rollups: rebuild them from the events, and check them."""


@ledger.command("rollup")
@click.option("--since", metavar="TIME", help="ISO 8601 time, UTC unless it has an offset.")
@click.option("--until", metavar="TIME", help="ISO 8601 time (exclusive).")
def ledger_rollup(since: str | None, until: str | None) -> None:
    """Rebuild the hourly rollups of every hour overlapping [--since, --until) from the
    usage events (default: all of them). Prints the number of rollup rows written."""
    from hotpool.billing.rollups import rebuild

    start, end = utc_time(since, "--since"), utc_time(until, "--until")
    if start is not None and end is not None and end <= start:
        raise click.BadParameter("must be after --since", param_hint="--until")
    with database() as db:
        try:
            written = rebuild(db, start, end)
        except ValueError as exc:  # events in two currencies
            raise click.ClickException(str(exc)) from None
    click.echo(f"{written} rollup rows written")


@ledger.command("check")
def ledger_check() -> None:
    """Check that every hourly rollup equals the sum of its events; exits 1 if one does
    not, or if an hour with events has no rollup."""
    from hotpool.billing.rollups import check

    with database() as db:
        mismatches = check(db)
    if not mismatches:
        click.echo("OK")
        return
    for mismatch in mismatches:
        click.echo(str(mismatch))
    raise SystemExit(1)
