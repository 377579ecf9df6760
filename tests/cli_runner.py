"""Running the ``hotpool`` CLI in tests (the `home` and `run` fixtures in conftest.py)."""

from __future__ import annotations

from click.testing import CliRunner, Result

from hotpool.cli import main


def invoke(runner: CliRunner, *args: str, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(main, list(args), env=env, catch_exceptions=False)
