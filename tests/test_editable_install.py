"""The plain ``pip install -e .`` a contributor types first (setuptools' default, "lenient"
editable mode, not the Makefile's strict one) gives a working hotpool, in a fresh venv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _source_tree(dest: Path) -> None:
    """What a fresh clone holds for the build: pyproject, README, the build backend and each
    package folder (copied, so that the build writes nothing into this checkout)."""
    folders = [
        *PYPROJECT["tool"]["setuptools"]["package-dir"].values(),
        *PYPROJECT["build-system"]["backend-path"],
    ]
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy2(REPO / name, dest / name)
    for folder in folders:
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))


def _fresh_venv(dest: Path) -> Path:
    """A venv of its own, with no hotpool and no pip or setuptools in it: its one ``.pth``
    appends this environment's site-packages, so that the dependencies (torch among them) and
    the build tools import without being installed again, and offline. (A ``.pth``'s folders
    are appended after the venv's own, and the ``.pth`` files in them are not run: this
    environment's own install of hotpool stays out of sight.)"""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "hotpool-test-deps.pth").write_text("\n".join(ours) + "\n")
    return python


def _run(
    args: list[str | Path], cwd: Path, env: dict[str, str] | None = None, rc: int = 0
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == rc, f"{' '.join(map(str, args))}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.mark.slow
def test_plain_editable_install_imports_every_subpackage_and_runs_the_cli(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _source_tree(src)
    python = _fresh_venv(tmp_path / "venv")
    # A contributor's command, with only what keeps it offline and fast: no dependencies (the
    # .pth brings them) and no isolated build environment. The editable mode is the default.
    pip = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation"]
    _run([*pip, "-e", "."], src)

    packages = PYPROJECT["tool"]["setuptools"]["packages"]
    code = (
        "import importlib, json;"
        f"mods = [importlib.import_module(p) for p in {packages!r}];"
        "import hotpool.platform.app;"
        "print(json.dumps({m.__name__: list(m.__path__) for m in mods}))"
    )
    paths = json.loads(_run([python, "-c", code], tmp_path).stdout)
    assert set(paths) == set(packages)
    for name, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        assert paths[name] == [str(src / folder)], name  # the source folder itself

    hotpool = python.parent / "hotpool"
    assert "Usage: hotpool" in _run([hotpool, "--help"], tmp_path).stdout
    # `hotpool serve` imports the control plane, then stops at the bad setting (no server).
    env = {**os.environ, "HOTPOOL_HOME": str(tmp_path / "home"), "HOTPOOL_PORT": "no-port"}
    serve = _run([hotpool, "serve"], tmp_path, env, rc=2)
    assert "HOTPOOL_PORT='no-port' is invalid" in serve.stderr, serve.stderr

    # An editable install sees a new file without a reinstall, in platform/ too.
    (src / "platform" / "probe_module.py").write_text("ANSWER = 42\n")
    probe = _run([python, "-c", "import hotpool.platform.probe_module as m; print(m.ANSWER)"], src)
    assert probe.stdout.strip() == "42"

    # From the source root, `platform` is still the standard library's.
    std = _run([python, "-c", "import platform; platform.system(); print(platform.__file__)"], src)
    assert not Path(std.stdout.strip()).is_relative_to(src), std.stdout


@pytest.mark.slow
def test_make_install_reinstalls_only_when_the_project_changed_and_warns_nothing(
    tmp_path: Path,
) -> None:
    """`make run`'s install step: silent and instant when nothing changed, a real strict
    editable install (and no setuptools warnings) when a file was added."""
    src = tmp_path / "src"
    src.mkdir()
    _source_tree(src)
    venv = tmp_path / "venv"
    python = _fresh_venv(venv)
    script = src / "build_backend" / "install_if_changed.py"
    # Offline: pip's own settings, from the environment, reach the script's pip.
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_NO_DEPS": "1", "PIP_NO_BUILD_ISOLATION": "0"}

    first = _run([python, script, venv], src, env)
    assert "installing" in first.stdout
    assert "Warning" not in first.stdout + first.stderr, first.stdout + first.stderr
    probe = "import hotpool.platform.app, hotpool.cli; print('ok')"
    assert _run([python, "-c", probe], tmp_path).stdout.strip() == "ok"

    again = _run([python, script, venv], src, env)
    assert again.stdout == again.stderr == ""  # nothing changed: no pip at all

    (src / "core" / "settings.py").write_text((src / "core" / "settings.py").read_text() + "\n")
    assert _run([python, script, venv], src, env).stdout == ""  # an edit is live through links

    (src / "platform" / "probe_module.py").write_text("ANSWER = 42\n")
    added = _run([python, script, venv], src, env)
    assert "installing" in added.stdout
    probe = "import hotpool.platform.probe_module as m; print(m.ANSWER)"
    assert _run([python, "-c", probe], tmp_path).stdout.strip() == "42"
