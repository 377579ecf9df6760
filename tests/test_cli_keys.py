"""``hotpool tenants`` and ``hotpool keys``, run in-process against the SQLite ledger of a
temporary HOTPOOL_HOME."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runner import invoke
from click.testing import CliRunner, Result

from hotpool.billing.db import Database
from hotpool.billing.keys import KeyStore


def ok(runner: CliRunner, *args: str) -> Result:
    result = invoke(runner, *args)
    assert result.exit_code == 0, result.output
    return result


def one_line_error(result: Result, code: int, *parts: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: "), result.stderr
    for part in parts:
        assert part in last


def _key_store(url: str) -> Iterator[KeyStore]:
    db = Database(url)
    try:
        yield KeyStore(db)
    finally:
        db.dispose()


@pytest.fixture
def keystore(home: Path) -> Iterator[KeyStore]:
    """The keys of the CLI's own ledger, read directly."""
    yield from _key_store(f"sqlite:///{home / 'hotpool.db'}")


@pytest.mark.parametrize(
    ("args", "purpose"),
    [
        (("tenants",), "Tenants: who owns"),
        (("tenants", "create"), "Create tenant NAME"),
        (("tenants", "list"), "List every tenant"),
        (("keys",), "API keys: create (shown once)"),
        (("keys", "create"), "print it, once"),
        (("keys", "list"), "never the keys themselves"),
        (("keys", "revoke"), "Revoke the API key"),
    ],
)
def test_help_says_what_each_command_does(
    run: CliRunner, args: tuple[str, ...], purpose: str
) -> None:
    result = ok(run, *args, "--help")
    assert purpose in result.output
    assert "Usage: " in result.output


def test_main_help_lists_tenants_and_keys(run: CliRunner) -> None:
    out = ok(run, "-h").output
    assert "  tenants " in out and "  keys " in out


def test_tenants_create_and_list(run: CliRunner, home: Path) -> None:
    result = ok(run, "tenants", "create", "acme")
    assert result.stdout == "created tenant acme (id 2)\n"
    assert (home / "hotpool.db").is_file()  # the SQLite ledger was made and migrated
    ok(run, "tenants", "create", "ml-research")

    lines = ok(run, "tenants", "list").stdout.splitlines()
    assert lines[0].split() == ["ID", "NAME", "CREATED", "(UTC)"]
    assert [line.split()[:2] for line in lines[1:]] == [
        ["1", "default"],
        ["2", "acme"],
        ["3", "ml-research"],
    ]


def test_tenants_create_errors(run: CliRunner) -> None:
    ok(run, "tenants", "create", "acme")
    one_line_error(invoke(run, "tenants", "create", "acme"), 1, "tenant 'acme' already exists")
    one_line_error(invoke(run, "tenants", "create", "default"), 1, "already exists")
    one_line_error(invoke(run, "tenants", "create", "Not Valid"), 2, "NAME", "invalid tenant name")
    one_line_error(invoke(run, "tenants", "create", "x" * 65), 2, "1 to 64 characters")


def test_keys_create_prints_only_the_key_on_stdout(run: CliRunner, keystore: KeyStore) -> None:
    ok(run, "tenants", "create", "acme")
    result = ok(
        run, "keys", "create", "--tenant", "acme", "--scopes", "invoke,usage", "--name", "ci"
    )
    assert re.fullmatch(r"hp_[A-Za-z0-9]{40}\n", result.stdout), result.stdout
    key = result.stdout.strip()
    assert key not in result.stderr
    assert f"created key {key[:11]} for tenant acme" in result.stderr
    assert "invoke,usage" in result.stderr

    record = keystore.authenticate(key)
    assert record is not None
    assert record.name == "ci" and record.scopes == {"invoke", "usage"}


def test_keys_list_shows_prefixes_never_keys(run: CliRunner) -> None:
    ok(run, "tenants", "create", "acme")
    admin = ok(run, "keys", "create", "--tenant", "default", "--scopes", "admin").stdout.strip()
    ci = ok(
        run, "keys", "create", "--tenant", "acme", "--scopes", "deploy,invoke", "--name", "ci"
    ).stdout.strip()

    out = ok(run, "keys", "list").stdout
    assert admin not in out and ci not in out
    header, *rows = out.splitlines()
    assert header.split() == [
        "PREFIX", "TENANT", "NAME", "SCOPES", "CREATED", "(UTC)", "LAST", "USED", "REVOKED"
    ]  # fmt: skip
    # Newest first; times are "YYYY-MM-DD HH:MM"; never used, not revoked.
    assert [row.split()[:4] for row in rows] == [
        [ci[:11], "acme", "ci", "deploy,invoke"],
        [admin[:11], "default", "-", "admin"],
    ]
    assert all(row.split()[-2:] == ["-", "-"] for row in rows)

    only_acme = ok(run, "keys", "list", "--tenant", "acme").stdout.splitlines()
    assert [row.split()[0] for row in only_acme[1:]] == [ci[:11]]


def test_keys_list_when_there_are_none(run: CliRunner) -> None:
    result = ok(run, "keys", "list")
    assert result.stdout == ""
    assert "no API keys" in result.stderr


def test_revoke(run: CliRunner, keystore: KeyStore) -> None:
    key = ok(run, "keys", "create", "--tenant", "default", "--scopes", "invoke").stdout.strip()
    other = ok(run, "keys", "create", "--tenant", "default", "--scopes", "invoke").stdout.strip()
    assert keystore.authenticate(key) is not None

    result = ok(run, "keys", "revoke", key[:11])
    assert result.stdout.startswith(f"revoked {key[:11]} at ")
    assert keystore.authenticate(key) is None
    assert keystore.authenticate(other) is not None
    # Revoking again is harmless, and the listing shows when.
    ok(run, "keys", "revoke", key[:11])
    [row] = [r for r in ok(run, "keys", "list").stdout.splitlines() if r.startswith(key[:11])]
    assert re.search(r"  - +\d{4}-\d\d-\d\d \d\d:\d\d$", row), row  # never used, revoked


def test_keys_errors_are_one_line(run: CliRunner) -> None:
    one_line_error(
        invoke(run, "keys", "create", "--tenant", "acme", "--scopes", "invoke"),
        1,
        "tenant 'acme' does not exist",
        "`hotpool tenants create acme`",
    )
    one_line_error(
        invoke(run, "keys", "create", "--tenant", "default", "--scopes", "invoke,root"),
        2,
        "--scopes",
        "unknown scope 'root'",
    )
    one_line_error(
        invoke(run, "keys", "create", "--tenant", "default", "--scopes", ""), 2, "no scopes"
    )
    one_line_error(
        invoke(run, "keys", "create", "--tenant", "default", "--scopes", "invoke", "--name", ""),
        2,
        "--name",
    )
    one_line_error(invoke(run, "keys", "create", "--tenant", "default"), 2, "--scopes")
    one_line_error(invoke(run, "keys", "list", "--tenant", "nobody"), 1, "'nobody' does not exist")
    one_line_error(
        invoke(run, "keys", "revoke", "hp_nothere1"), 1, "no API key with prefix 'hp_nothere1'"
    )
    one_line_error(invoke(run, "keys", "revoke", "garbage"), 1, "no API key")


def test_a_bad_setting_stops_the_commands(run: CliRunner) -> None:
    for args in (("tenants", "list"), ("keys", "list")):
        result = invoke(run, *args, env={"HOTPOOL_DEVICE": "tpu"})
        assert result.exit_code == 2
        assert "HOTPOOL_DEVICE" in result.stderr
        assert "Traceback" not in result.output


def test_an_unreachable_database_is_one_line(run: CliRunner) -> None:
    url = "postgresql+psycopg2://nobody@127.0.0.1:1/none"
    result = invoke(run, "keys", "list", env={"HOTPOOL_DATABASE_URL": url})
    one_line_error(result, 1, "cannot use the database")
    assert "127.0.0.1:1" in result.stderr


def test_keys_work_on_a_database_url(run: CliRunner, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'elsewhere' / 'ledger.db'}"
    key = invoke(
        run, "keys", "create", "--tenant", "default", "--scopes", "admin",
        env={"HOTPOOL_DATABASE_URL": url},
    ).stdout.strip()  # fmt: skip
    for store in _key_store(url):
        assert store.authenticate(key) is not None
