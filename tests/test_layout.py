"""The package layout DESIGN.md promises, and the one-way imports between layers."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_import_platform_from_repo_root_is_the_standard_library() -> None:
    # `python -c` puts the current directory (the repo root) first on sys.path.
    path = _run("import platform; platform.system(); print(platform.__file__)")
    assert not Path(path).is_relative_to(REPO), path
    assert not (REPO / "platform" / "__init__.py").exists()


def test_control_plane_imports_with_repo_root_on_path_and_without_torch() -> None:
    code = (
        "import sys; sys.path.insert(0, '.');"
        "import platform, uuid; platform.system(); uuid.uuid4();"
        "import hotpool.platform.app, hotpool.cli; print('torch' in sys.modules)"
    )
    assert _run(code) == "False"  # the control plane never imports torch code


def test_every_code_folder_is_a_declared_package() -> None:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: REPO / folder for name, folder in cfg["package-dir"].items()}
    declared = set(cfg["packages"])
    for top, folder in dirs.items():
        for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
            if "__pycache__" in sub.parts or not any(sub.glob("*.py")):
                continue
            name = ".".join([top, *sub.relative_to(folder).parts])
            assert name in declared, (
                f"{sub} holds Python files but {name} is not in pyproject packages"
            )


# Who may import whom (DESIGN.md): worker -> kernels; pool -> billing (and the worker's
# protocol module); platform -> pool, billing; migrations -> billing.
FORBIDDEN = {
    "worker": ("hotpool.platform", "hotpool.pool", "hotpool.billing"),
    "kernels": ("hotpool.platform", "hotpool.pool", "hotpool.billing", "hotpool.worker"),
    "billing": ("hotpool.platform", "hotpool.pool", "hotpool.worker", "hotpool.kernels"),
    "pool": ("hotpool.platform", "hotpool.kernels", "torch"),
    "platform": ("hotpool.kernels", "torch"),
}
PROTOCOL = "hotpool.worker.protocol"
# The worker's text side, which the router runs too, to hash a prompt as its worker will
# (cache-aware routing): pure Python, no torch (test_light_worker_modules_import_no_torch).
SHARED = (
    PROTOCOL,
    "hotpool.worker.prompt",
    "hotpool.worker.prefix_hash",
    "hotpool.worker.tokenizer",
)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_layers_import_one_way() -> None:
    bad = []
    for folder, forbidden in FORBIDDEN.items():
        for path in (REPO / folder).rglob("*.py"):
            for name in _imports(path):
                if folder in ("pool", "platform") and name in SHARED:
                    continue
                if folder in ("pool", "platform") and name.startswith("hotpool.worker"):
                    bad.append(
                        f"{path.relative_to(REPO)} imports {name} (only {SHARED} are allowed)"
                    )
                if name.startswith(forbidden):
                    bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_light_worker_modules_import_no_torch() -> None:
    """What the control plane imports of the worker stays light: no torch, no engine."""
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in SHARED)
        + (
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith("
            "('hotpool.worker.engine', 'hotpool.worker.models')))\n"
            "assert not heavy, heavy\n"
        )
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
