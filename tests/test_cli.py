"""The ``hotpool`` command line, run in-process: help, settings errors, the database
commands, and what a user sees when the control plane is not running."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from cli_runner import invoke
from click.testing import CliRunner, Result

from hotpool.platform.ledger_writer import lock_spool


@pytest.fixture
def dead_url() -> str:
    """A local URL where nothing listens (a port just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


HELP = [
    ((), "self-hosted serverless GPU platform"),
    (("serve",), "Run the control plane"),
    (("worker",), "Run one worker process"),
    (("models",), "models you can pull"),
    (("models", "pull"), "Download MODEL"),
    (("deploy",), "Create deployment NAME"),
    (("invoke",), "Send PROMPT to deployment NAME"),
    (("usage",), "Token usage per deployment"),
    (("db",), "Ledger database schema"),
    (("db", "upgrade"), "Migrate the database"),
    (("db", "current"), "current revision"),
]


@pytest.mark.parametrize(("args", "purpose"), HELP, ids=[" ".join(a) or "hotpool" for a, _ in HELP])
def test_help_says_what_each_command_does(
    run: CliRunner, args: tuple[str, ...], purpose: str
) -> None:
    result = invoke(run, *args, "--help")
    assert result.exit_code == 0, result.output
    assert purpose in result.output
    assert "Usage: " in result.output


def test_group_help_lists_every_command(run: CliRunner) -> None:
    out = invoke(run, "-h").output
    for command in ("serve", "worker", "models", "deploy", "invoke", "usage", "db"):
        assert f"  {command} " in out


def test_version(run: CliRunner) -> None:
    result = invoke(run, "--version")
    assert result.exit_code == 0
    assert result.output.startswith("hotpool, version ")


def test_bad_setting_is_one_line_and_exit_2(run: CliRunner) -> None:
    result = invoke(run, "serve", env={"HOTPOOL_PORT": "abc"})
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hotpool: HOTPOOL_PORT='abc' is invalid")


@pytest.mark.parametrize(
    "args", [("db", "upgrade"), ("db", "current"), ("models", "pull", "smollm2")]
)
def test_bad_setting_stops_other_commands_too(run: CliRunner, args: tuple[str, ...]) -> None:
    result = invoke(run, *args, env={"HOTPOOL_DEVICE": "tpu"})
    assert result.exit_code == 2
    assert "HOTPOOL_DEVICE" in result.stderr
    assert "Traceback" not in result.output


def test_db_upgrade_then_current(run: CliRunner, home: Path) -> None:
    result = invoke(run, "db", "current")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "(empty)"

    result = invoke(run, "db", "upgrade")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "database at revision 0011"
    assert (home / "hotpool.db").is_file()

    result = invoke(run, "db", "current")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "0011"

    # Upgrading again is a no-op.
    assert invoke(run, "db", "upgrade").stdout.strip() == "database at revision 0011"


def test_db_upgrade_honours_database_url(run: CliRunner, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'elsewhere' / 'ledger.db'}"
    result = invoke(run, "db", "upgrade", env={"HOTPOOL_DATABASE_URL": url})
    assert result.exit_code == 0, result.output
    assert (tmp_path / "elsewhere" / "ledger.db").is_file()


def _one_line_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


DATABASES = [
    ("postgresql+psycopg2://u:secret@127.0.0.1:1/x", "Connection refused"),
    ("postgresql://127.0.0.1:1/x", "postgresql+psycopg2://"),  # SQLAlchemy's psycopg 3
    ("notaurl", "is not a database URL"),
    ("foo://x", "needs a database driver"),
]


@pytest.mark.parametrize(("url", "says"), DATABASES)
@pytest.mark.parametrize(
    "args", [("db", "current"), ("db", "upgrade"), ("tenants", "list"), ("keys", "list")]
)
def test_a_database_that_cannot_be_used_is_one_line(
    run: CliRunner, url: str, says: str, args: tuple[str, ...]
) -> None:
    line = _one_line_error(invoke(run, *args, env={"HOTPOOL_DATABASE_URL": url}))
    assert says in line and "secret" not in line


def test_a_home_that_is_a_file_is_one_line(run: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    env = {"HOTPOOL_HOME": str(tmp_path / "file")}
    for args in (("db", "current"), ("tenants", "list"), ("ledger", "check"), ("serve",)):
        assert "File exists" in _one_line_error(invoke(run, *args, env=env))


def test_a_second_serve_on_one_home_is_one_line_before_any_banner(
    run: CliRunner, home: Path
) -> None:
    """The spool lock a running `hotpool serve` holds (taken here in this process, as the
    first server's ledger writer takes it) stops a second one before it prints its banner."""
    fd = lock_spool(home / "spool")
    try:
        result = invoke(run, "serve", "--port", "0")
    finally:
        os.close(fd)
    line = _one_line_error(result)
    assert "another hotpool process uses the spool folder" in line
    assert f"is another `hotpool serve` running on {home}" in line
    assert "serving on" not in result.output


def test_an_unknown_revision_is_one_line(run: CliRunner) -> None:
    assert "nosuchrev" in _one_line_error(invoke(run, "db", "upgrade", "--revision", "nosuchrev"))


@pytest.mark.parametrize(
    "args",
    [
        ("prices", "set", "--input", "1", "--cached-input", "0", "--output", "0",
         "--effective-from", "0001-01-01T00:00:00+01:00"),
        ("prices", "set", "--input", "1", "--cached-input", "0", "--output", "0",
         "--effective-from", "9999-12-31T23:00:00-05:00"),
        ("ledger", "rollup", "--since", "0001-01-01T00:00:00+01:00"),
        ("ledger", "rollup", "--until", "9999-12-31T23:59:59-05:00"),
    ],
)  # fmt: skip
def test_times_out_of_range_are_usage_errors(run: CliRunner, args: tuple[str, ...]) -> None:
    result = invoke(run, *args)
    assert result.exit_code == 2 and "outside the times hotpool keeps" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "args",
    [
        ("deploy", "tiny", "--snapshot", "file:///nowhere"),
        ("deploy", "tiny", "--snapshot", "tiny"),
        ("invoke", "tiny", "hello"),
        ("invoke", "tiny", "hello", "--raw"),
        ("usage",),
        ("usage", "--json", "--bucket-width", "1h"),
    ],
)
def test_client_commands_say_when_hotpool_is_unreachable(
    run: CliRunner, dead_url: str, args: tuple[str, ...]
) -> None:
    result = invoke(run, *args, "--url", dead_url)
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert f"cannot reach hotpool at {dead_url}" in result.stderr
    assert "hotpool serve" in result.stderr


def test_client_commands_default_to_hotpool_port(run: CliRunner, dead_url: str) -> None:
    port = dead_url.rsplit(":", 1)[1]
    result = invoke(run, "usage", env={"HOTPOOL_PORT": port})
    assert result.exit_code != 0
    assert f"cannot reach hotpool at http://127.0.0.1:{port}/v1/usage" in result.stderr


@pytest.mark.parametrize("command", [("usage",), ("invoke", "tiny", "hi")])
def test_client_commands_check_hotpool_port(run: CliRunner, command: tuple[str, ...]) -> None:
    result = invoke(run, *command, env={"HOTPOOL_PORT": "abc"})
    assert result.exit_code == 2
    assert result.stderr.startswith("hotpool: HOTPOOL_PORT='abc' is invalid")
    assert "Traceback" not in result.output


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://127.0.0.1", "http://127.0.0.1:abc"])
def test_malformed_url_is_a_clear_error(run: CliRunner, url: str) -> None:
    result = invoke(run, "usage", "--url", url)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: invalid hotpool URL")
    assert "Traceback" not in result.output


def test_unknown_model_to_pull_is_a_usage_error(run: CliRunner) -> None:
    result = invoke(run, "models", "pull", "gpt-5")
    assert result.exit_code == 1  # one line naming the catalog (tests/test_cli_snapshot.py)
    assert "smollm2" in result.output


def test_worker_needs_its_token(run: CliRunner) -> None:
    result = invoke(run, "worker", "--worker-id", "w1", "--control-plane", "http://127.0.0.1:1")
    assert result.exit_code != 0
    assert "HOTPOOL_WORKER_TOKEN" in result.stderr
