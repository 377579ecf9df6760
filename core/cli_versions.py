"""``hotpool promote``, ``hotpool rollback`` and ``hotpool versions``: a deployment's
versions and its canary, over the running server's API (``hotpool deploy --canary`` starts
one)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import click

from hotpool.cli_common import api_url, call_api, print_table

URL_OPTION = click.option("--url", help="hotpool API (default http://127.0.0.1:$HOTPOOL_PORT).")


def describe(deployment: dict[str, Any]) -> str:
    """One line on who serves a deployment's traffic."""
    line = f"{deployment['name']}: version {deployment['version']} is stable"
    canary = deployment.get("canary")
    if canary:
        line += f"; version {canary['version']} takes {canary['percent']:g}% (canary)"
    return line


@click.command()
@click.argument("name")
@URL_OPTION
def promote(name: str, url: str | None) -> None:
    """Make deployment NAME's canary its stable version; the old one drains."""
    _act(name, "promote", url)


@click.command()
@click.argument("name")
@URL_OPTION
def rollback(name: str, url: str | None) -> None:
    """Send all of NAME's traffic back to the previous stable version, at once."""
    _act(name, "rollback", url)


def _act(name: str, action: str, url: str | None) -> None:
    click.echo(describe(call_api("POST", f"{api_url(url)}/v1/deployments/{name}/{action}")))


@click.command()
@click.argument("name")
@URL_OPTION
def versions(name: str, url: str | None) -> None:
    """List deployment NAME's versions: role, traffic share, snapshot, quantization, who and
    when."""
    out = call_api("GET", f"{api_url(url)}/v1/deployments/{name}/versions")
    rows = [
        [
            str(v["version"]),
            v["role"] or "",
            f"{v['traffic_percent']:g}%" if v["traffic_percent"] is not None else "",
            v["snapshot_uri"],
            v["engine"]["quantization"],
            v["created_by"] or "",
            _when(v["created_at"]),
        ]
        for v in out["data"]
    ]
    print_table(["version", "role", "traffic", "snapshot", "quantization", "by", "created"], rows)


def _when(unix: int | None) -> str:
    return "" if unix is None else datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
