"""hotpool's build backend: setuptools', plus the one thing its default editable install misses.

``pip install -e .`` (setuptools' default, "lenient" editable mode) installs a finder that maps
each ``[tool.setuptools.package-dir]`` entry to its folder, but a mapped folder without
``__init__.py`` is found by nothing (pypa/setuptools#4943): for ``hotpool.platform`` the
finder looks for ``platform/__init__.py`` or ``platform.py`` and gives up, and the import
system only searches ``hotpool.__path__`` (``core/``), so ``hotpool serve`` fails with
``ModuleNotFoundError: No module named 'hotpool.platform'``. ``platform/`` must stay without
``__init__.py`` (DESIGN.md: a regular package named ``platform`` at the repository root
shadows the standard library's), so this backend adds a second, small finder to such an
editable wheel that maps each of those folders as a namespace package.

Wheels, sdists and strict editable installs (``--config-settings editable_mode=strict``, the
Makefile's) are setuptools' own, unchanged (less the strict mode's warning that its link
tree must stay). Only the PEP 517 hooks and the wheel format are
relied on, not setuptools' internals.
"""

from __future__ import annotations

import base64
import hashlib
import tomllib
import warnings
import zipfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every other PEP 517 hook, as setuptools has it)

FINDER_SOURCE = '''\
"""hotpool's namespace subpackages for its editable install (see build_backend/ in its
source tree): setuptools' own finder does not find a mapped folder without __init__.py."""

import sys
from importlib.machinery import ModuleSpec

NAMESPACES = {namespaces!r}


class NamespaceFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = NAMESPACES.get(fullname)
        if folder is None:
            return None
        spec = ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [folder]
        return spec


def install():
    if NamespaceFinder not in sys.meta_path:
        sys.meta_path.append(NamespaceFinder)
'''


def build_editable(
    wheel_directory: str,
    config_settings: dict[str, str | list[str]] | None = None,
    metadata_directory: str | None = None,
) -> str:
    with warnings.catch_warnings():
        # setuptools' strict mode warns on every install that its link tree must not be
        # removed: 14 lines that read like a failure at each `make run`. build/ says so.
        warnings.filterwarnings("ignore", message="Editable installation")
        _quiet_about_dashboard_assets()
        name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    wheel = Path(wheel_directory) / name
    namespaces = namespace_subpackages(Path.cwd())  # PEP 517: hooks run in the source tree
    finder = _lenient_finder(wheel)
    if namespaces and finder is not None:
        module = finder.removesuffix("_finder.py") + "_namespaces"
        _add_to_wheel(
            wheel,
            {
                f"{module}.py": FINDER_SOURCE.format(namespaces=namespaces),
                f"{module}.pth": f"import {module}; {module}.install()\n",
            },
        )
    return name


def build_wheel(
    wheel_directory: str,
    config_settings: dict[str, str | list[str]] | None = None,
    metadata_directory: str | None = None,
) -> str:
    with warnings.catch_warnings():
        _quiet_about_dashboard_assets()
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def _quiet_about_dashboard_assets() -> None:
    """platform/dashboard/ holds the page's files beside platform/dashboard.py, the module
    that serves them: a folder Python cannot import as a package (the module wins), so it is
    package data of hotpool.platform, which setuptools warns about at length each build."""
    warnings.filterwarnings("ignore", message=r"(?s).*hotpool\.platform\.dashboard")


def namespace_subpackages(root: Path) -> dict[str, str]:
    """Each subpackage whose folder has no ``__init__.py`` (a ``package-dir`` entry such as
    ``platform/``, or a data-only folder in ``packages``): its folder.

    (A top-level namespace package is setuptools' own finder's job, and it does it.)"""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {})
    setuptools = setuptools.get("setuptools", {})
    package_dir: dict[str, str] = setuptools.get("package-dir", {})
    found = {}
    for name in dict.fromkeys([*package_dir, *setuptools.get("packages", [])]):
        path = _folder(root, package_dir, name)
        if "." in name and path.is_dir() and not (path / "__init__.py").exists():
            found[name] = str(path)
    return found


def _folder(root: Path, package_dir: dict[str, str], name: str) -> Path:
    """The folder of package ``name``: its nearest mapped ancestor's folder, plus the rest."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        mapped = package_dir.get(".".join(parts[:cut]))
        if mapped is not None:
            return (root / mapped).joinpath(*parts[cut:]).resolve()
    return root.joinpath(*parts).resolve()


def _lenient_finder(wheel: Path) -> str | None:
    """The name of setuptools' lenient-mode finder module in ``wheel``; None in a strict
    editable wheel (a tree of links, where a folder without ``__init__.py`` imports as is)."""
    with zipfile.ZipFile(wheel) as z:
        return next(
            (n for n in z.namelist() if n.startswith("__editable___") and n.endswith("_finder.py")),
            None,
        )


def _add_to_wheel(wheel: Path, files: dict[str, str]) -> None:
    """Rewrite ``wheel`` with ``files`` added at its root and listed in its RECORD (so that
    ``pip uninstall`` removes them too)."""
    with zipfile.ZipFile(wheel) as old:
        entries = [(info, old.read(info)) for info in old.infolist()]
    (record_info,) = [i for i, _ in entries if i.filename.endswith(".dist-info/RECORD")]
    record = dict(entries)[record_info].decode().splitlines()
    own_line = f"{record_info.filename},,"
    lines = [line for line in record if line and line != own_line]
    partial = wheel.with_name(wheel.name + ".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as new:
        for info, data in entries:
            if info is not record_info:
                new.writestr(info, data)
        for name, text in files.items():
            data = text.encode()
            info = zipfile.ZipInfo(name, date_time=record_info.date_time)
            info.external_attr = 0o644 << 16
            new.writestr(info, data, zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            lines.append(f"{name},sha256={digest.decode()},{len(data)}")
        new.writestr(record_info, "\n".join([*lines, own_line]) + "\n")
    partial.replace(wheel)
