"""`hotpool tenants` and `hotpool keys`: tenants and their API keys, straight in the database.

These commands talk to the database of the current settings, not to a running server, so
an operator can make the first operator or admin key before anything serves. Like
`hotpool serve`, they migrate a SQLite ledger themselves; a server database must be upgraded
with `hotpool db upgrade` first.
"""

from __future__ import annotations

from datetime import datetime

import click

from hotpool.cli_common import database, print_table


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


@click.group()
def tenants() -> None:
    """Tenants: who owns deployments, API keys and usage."""


@tenants.command("create")
@click.argument("name")
def tenants_create(name: str) -> None:
    """Create tenant NAME (a-z, 0-9, '.', '_', '-'; at most 64 characters)."""
    from hotpool.billing.tenants import TenantExists, TenantStore, check_tenant_name

    try:
        check_tenant_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    with database() as db:
        try:
            tenant = TenantStore(db).create(name)
        except TenantExists as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"created tenant {tenant.name} (id {tenant.id})")


@tenants.command("list")
def tenants_list() -> None:
    """List every tenant."""
    from hotpool.billing.tenants import TenantStore

    with database() as db:
        rows = TenantStore(db).list()
    print_table(
        ("ID", "NAME", "CREATED (UTC)"),
        [(str(t.id), t.name, _when(t.created_at)) for t in rows],
    )


@click.group()
def keys() -> None:
    """API keys: create (shown once), list and revoke.

    A key carries scopes: deploy (manage deployments), invoke (run requests), usage (read
    usage), admin (everything in its tenant, its keys included) and operator (everything in
    every tenant: tenants, every tenant's keys and usage).
    """


@keys.command("create")
@click.option("--tenant", "tenant_name", required=True, help="Name of the tenant the key acts as.")
@click.option(
    "--scopes",
    required=True,
    metavar="LIST",
    help="Comma-separated scopes: deploy, invoke, usage, admin, operator.",
)
@click.option("--name", "label", help="A label for the key, e.g. who or what uses it.")
def keys_create(tenant_name: str, scopes: str, label: str | None) -> None:
    """Create an API key and print it, once, alone on stdout.

    `KEY=$(hotpool keys create ...)` captures just the key; the rest goes to stderr.
    """
    from hotpool.billing.keys import KEY_NAME_MAX_LEN, KeyStore, parse_scopes
    from hotpool.billing.tenants import TenantStore

    try:
        allowed = parse_scopes(scopes)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--scopes") from None
    if label is not None and not 1 <= len(label) <= KEY_NAME_MAX_LEN:
        raise click.BadParameter(f"must be 1 to {KEY_NAME_MAX_LEN} characters", param_hint="--name")
    with database() as db:
        tenant = TenantStore(db).by_name(tenant_name)
        if tenant is None:
            raise click.ClickException(
                f"tenant {tenant_name!r} does not exist; create it with"
                f" `hotpool tenants create {tenant_name}`"
            )
        record, key = KeyStore(db).create(tenant.id, allowed, label)
    click.echo(
        f"created key {record.prefix} for tenant {tenant.name} with scopes"
        f" {','.join(sorted(record.scopes))}; it is shown only now, keep it safe",
        err=True,
    )
    click.echo(key)


@keys.command("list")
@click.option("--tenant", "tenant_name", help="Only this tenant's keys.")
def keys_list(tenant_name: str | None) -> None:
    """List API keys, newest first (never the keys themselves)."""
    from hotpool.billing.keys import KeyStore
    from hotpool.billing.tenants import TenantStore

    with database() as db:
        store = TenantStore(db)
        names = {t.id: t.name for t in store.list()}
        tenant_id = None
        if tenant_name is not None:
            tenant = store.by_name(tenant_name)
            if tenant is None:
                raise click.ClickException(f"tenant {tenant_name!r} does not exist")
            tenant_id = tenant.id
        records = KeyStore(db).list(tenant_id)
    if not records:
        click.echo("no API keys; make one with `hotpool keys create`", err=True)
        return
    print_table(
        ("PREFIX", "TENANT", "NAME", "SCOPES", "CREATED (UTC)", "LAST USED", "REVOKED"),
        [
            (
                k.prefix,
                names.get(k.tenant_id, str(k.tenant_id)),
                k.name or "-",
                ",".join(sorted(k.scopes)),
                _when(k.created_at),
                _when(k.last_used_at),
                _when(k.revoked_at),
            )
            for k in records
        ],
    )


@keys.command("revoke")
@click.argument("prefix")
def keys_revoke(prefix: str) -> None:
    """Revoke the API key with prefix PREFIX.

    PREFIX is the key's start, as `hotpool keys list` shows it. Revoking twice is harmless.
    """
    from hotpool.billing.keys import KeyStore

    with database() as db:
        try:
            record = KeyStore(db).revoke(prefix)
        except KeyError:
            raise click.ClickException(
                f"no API key with prefix {prefix!r} (see `hotpool keys list`)"
            ) from None
    click.echo(f"revoked {record.prefix} at {_when(record.revoked_at)} UTC")
