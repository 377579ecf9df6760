"""`hotpool prices`: what tokens cost, set and listed straight in the database.

Like `hotpool keys`, these commands use the database of the current settings, not a running
server. Here amounts are written as people say them, in currency units per million tokens
(``--input 0.15``), and converted exactly to the integer micro-units the ledger keeps (the
HTTP API takes those integers directly).
"""

from __future__ import annotations

from datetime import UTC, datetime

import click

from hotpool.cli_common import database, print_table, utc_time


def _amount(value: str, option: str) -> int:
    from hotpool.billing.prices import MAX_PRICE_MICROS, format_micros, parse_amount

    try:
        micros = parse_amount(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None
    if micros > MAX_PRICE_MICROS:
        raise click.BadParameter(
            f"must be at most {format_micros(MAX_PRICE_MICROS)}", param_hint=option
        )
    return micros


@click.group()
def prices() -> None:
    """Prices per million tokens: per deployment or a default, each from a point in time.

    A request is billed, when it is recorded, at the price in force at its time: its
    deployment's own, else the default; with neither it has no cost.
    """


@prices.command("set")
@click.option("--deployment", help="The deployment this price is for (default: every other).")
@click.option(
    "--input",
    "input_",
    required=True,
    metavar="AMOUNT",
    help="Price of 1M input tokens, e.g. 0.15 (at most 6 decimal places).",
)
@click.option(
    "--cached-input",
    required=True,
    metavar="AMOUNT",
    help="Price of 1M input tokens served from the prefix cache.",
)
@click.option("--output", required=True, metavar="AMOUNT", help="Price of 1M output tokens.")
@click.option("--currency", default="USD", show_default=True, help="ISO 4217 code.")
@click.option(
    "--effective-from",
    metavar="TIME",
    help="ISO 8601 time the price starts at, UTC unless it has an offset (default: now).",
)
def prices_set(
    deployment: str | None,
    input_: str,
    cached_input: str,
    output: str,
    currency: str,
    effective_from: str | None,
) -> None:
    """Add a price. Requests recorded before keep the cost they were recorded with."""
    from hotpool.billing.prices import (
        CurrencyMismatch,
        PriceExists,
        PriceStore,
        check_deployment,
        format_micros,
    )

    if deployment is not None:
        try:
            check_deployment(deployment)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--deployment") from None
    amounts = (
        _amount(input_, "--input"),
        _amount(cached_input, "--cached-input"),
        _amount(output, "--output"),
    )
    at = utc_time(effective_from, "--effective-from")
    with database() as db:
        try:
            price = PriceStore(db).set(deployment, *amounts, effective_from=at, currency=currency)
        except (PriceExists, CurrencyMismatch) as exc:
            raise click.ClickException(str(exc)) from None
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    who = price.deployment or "every deployment without its own price"
    click.echo(
        f"{who}, from {price.effective_from:%Y-%m-%d %H:%M:%S} UTC: per 1M tokens,"
        f" input {format_micros(price.input)}, cached input {format_micros(price.cached_input)},"
        f" output {format_micros(price.output)} {price.currency}"
    )


@prices.command("list")
@click.option("--deployment", help="Only this deployment's own prices.")
def prices_list(deployment: str | None) -> None:
    """List prices per 1M tokens; IN FORCE marks those that apply now."""
    from hotpool.billing.prices import PriceStore, format_micros

    with database() as db:
        records = PriceStore(db).list(deployment)
    if not records:
        click.echo("no prices; set one with `hotpool prices set`", err=True)
        return
    now = datetime.now(UTC)
    current: dict[str | None, int | None] = {}
    for p in records:  # sorted by start within each deployment: the last one started wins
        if p.effective_from <= now:
            current[p.deployment] = p.id
    print_table(
        ("DEPLOYMENT", "CURRENCY", "INPUT", "CACHED INPUT", "OUTPUT", "FROM (UTC)", "IN FORCE"),
        [
            (
                p.deployment or "(default)",
                p.currency,
                format_micros(p.input),
                format_micros(p.cached_input),
                format_micros(p.output),
                f"{p.effective_from:%Y-%m-%d %H:%M:%S}",
                "yes" if current.get(p.deployment) == p.id else "",
            )
            for p in records
        ],
    )
