"""Every command in README.md's bash blocks is one this checkout runs as written: the venv's
``hotpool`` with subcommands and options it has, scripts and make targets that exist.
(tests/e2e/test_readme_tour.py runs them against a real server.)"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from readme_commands import README, Command, commands

from hotpool.cli import main

REPO = README.parent
COMMANDS = commands()


def _ids(found: list[Command]) -> list[str]:
    return [f"README.md:{c.line}" for c in found]


def test_the_readme_has_the_commands_this_file_checks() -> None:
    programs = {c.argv[0] for c in COMMANDS}
    assert {"make", "curl", ".venv/bin/hotpool", ".venv/bin/python"} <= programs
    assert [c.text for c in COMMANDS[:2]] == ["make run", "make test"]  # the two commands


def test_no_command_needs_an_activated_venv() -> None:
    """A bare ``hotpool`` is `command not found` until the venv is activated, which the
    README never asks for: every command names the venv's."""
    bare = [f"README.md:{c.line}: {c.text}" for c in COMMANDS if c.argv[0] in ("hotpool", "python")]
    assert bare == []


HOTPOOL = [c for c in COMMANDS if c.argv[0] == ".venv/bin/hotpool"]


# Files a command's user brings (checked to exist when the command is parsed).
USER_FILES = {"Qwen2.5-0.5B-Instruct": "folder", "SmolLM2.Q4_1.gguf": "file"}


@pytest.mark.parametrize("command", HOTPOOL, ids=_ids(HOTPOOL))
def test_each_hotpool_command_parses(
    command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its subcommands exist and click takes its arguments and options as written."""
    monkeypatch.chdir(tmp_path)
    for name, kind in USER_FILES.items():
        (tmp_path / name).mkdir() if kind == "folder" else (tmp_path / name).touch()
    cmd: click.Command = main
    args = command.argv[1:]
    path = ["hotpool"]
    while isinstance(cmd, click.Group):
        assert args, f"{command.text}: `{' '.join(path)}` needs a subcommand"
        name = args.pop(0)
        sub = cmd.commands.get(name)
        assert sub is not None, f"{command.text}: `{' '.join(path)}` has no command {name!r}"
        cmd, path = sub, [*path, name]
    try:
        cmd.make_context(" ".join(path), list(args))  # parses; runs nothing
    except click.ClickException as exc:
        pytest.fail(f"README.md:{command.line}: {command.text}\n{exc.format_message()}")


SCRIPTS = [c for c in COMMANDS if c.argv[0] in (".venv/bin/python", "bash")]


@pytest.mark.parametrize("command", SCRIPTS, ids=_ids(SCRIPTS))
def test_each_script_exists(command: Command) -> None:
    assert (REPO / command.argv[1]).is_file(), command.text


def test_each_make_target_exists() -> None:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    asked = {word for c in COMMANDS if c.argv[0] == "make" for word in c.argv[1:]}
    assert asked and asked <= targets
