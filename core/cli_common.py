"""Helpers every CLI module shares."""

from __future__ import annotations

import sys

import click

from hotpool.settings import Settings, SettingsError, load_settings


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
