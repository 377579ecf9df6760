"""Install hotpool into a venv (strict editable) only when the project changed since the last
install, so that `make run` starts in seconds the second time.

A strict editable install is a tree of links to the source files (build/__editable__.*): an
edit to a file is live at once, and only a new or removed file, or a change to
pyproject.toml (dependencies, package layout), needs pip again. The fingerprint is exactly
that: pyproject.toml's bytes, the extras asked for, and the list of files in the package
folders. It is kept in the venv, so a new venv installs afresh.

Usage: python build_backend/install_if_changed.py VENV [EXTRAS]
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP_NAME = ".hotpool-install"


def fingerprint(root: Path, extras: str) -> str:
    pyproject = (root / "pyproject.toml").read_bytes()
    package_dir = tomllib.loads(pyproject.decode())["tool"]["setuptools"]["package-dir"]
    digest = hashlib.sha256(pyproject + b"\0" + extras.encode())
    for folder in sorted(set(package_dir.values())):
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and not any(
                p == "__pycache__" or p.endswith(".egg-info") for p in path.parts
            ):
                digest.update(str(path.relative_to(root)).encode() + b"\0")
    build = sorted(root.glob("build/__editable__.hotpool-*"))  # removed by `make clean`
    digest.update(b"links" if build else b"no links")
    return digest.hexdigest()


def main(argv: list[str]) -> int:
    venv = Path(argv[1])
    extras = argv[2] if len(argv) > 2 else ""
    stamp = venv / STAMP_NAME
    want = fingerprint(ROOT, extras)
    last = stamp.read_text().strip() if stamp.exists() else None
    # An install with the test extras covers one without: `make test`, then `make run`.
    if last in (want, fingerprint(ROOT, "test")):
        return 0
    target = f".[{extras}]" if extras else "."
    print(f"hotpool: installing {target} into {venv} (new, or the project changed)", flush=True)
    command = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-e", target]
    subprocess.run([*command, "--config-settings", "editable_mode=strict"], check=True, cwd=ROOT)
    stamp.write_text(fingerprint(ROOT, extras) + "\n")  # after: the install made build/
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
