"""deploy/ as the tests read it, with no Docker engine or cluster: the Dockerfiles' parsed
instructions, the commands they and the manifests run, the compose file as ``docker compose
config`` would see it, the Kubernetes objects; and the ``HOTPOOL_*`` names hotpool reads."""

from __future__ import annotations

import ast
import io
import json
import re
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from hotpool.cli import main as hotpool_cli

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
CONTROL_PLANE = DEPLOY / "Dockerfile"
WORKER = DEPLOY / "Dockerfile.worker"
SETTINGS_PY = REPO / "core" / "settings.py"
ENV_NAME = re.compile(r"HOTPOOL_[A-Z0-9_]+")

Doc = dict[str, Any]


# --- the HOTPOOL_* names the code reads --------------------------------------------------


def env_constants(path: Path) -> set[str]:
    """String literals of ``path`` that are exactly a ``HOTPOOL_*`` name: the names the code
    looks up (a name inside a message or a docstring is not a lookup)."""
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and ENV_NAME.fullmatch(node.value)
    }


def settings_names() -> set[str]:
    """The settings ``core/settings.py`` reads and validates at start-up."""
    return env_constants(SETTINGS_PY)


def hotpool_env_names() -> set[str]:
    """Every ``HOTPOOL_*`` name the package looks up: the settings and the few variables read
    elsewhere (the CPU kernels')."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    names: set[str] = set()
    for folder in setuptools["package-dir"].values():
        for path in (REPO / folder).rglob("*.py"):
            names |= env_constants(path)
    return names


# --- Dockerfiles -------------------------------------------------------------------------


@cache
def instructions(dockerfile: Path) -> tuple[tuple[str, str], ...]:
    """``(INSTRUCTION, value)`` pairs, comments dropped, continuation lines joined."""
    parser = DockerfileParser(fileobj=io.BytesIO(dockerfile.read_bytes()), env_replace=False)
    return tuple(
        (s["instruction"], s["value"]) for s in parser.structure if s["instruction"] != "COMMENT"
    )


def values(dockerfile: Path, instruction: str) -> list[str]:
    return [v for i, v in instructions(dockerfile) if i == instruction]


def build_args(dockerfile: Path) -> dict[str, str]:
    """Every ARG's default, before and after FROM."""
    return dict(v.split("=", 1) for v in values(dockerfile, "ARG") if "=" in v)


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ENV the image sets (``ENV A=1 B=2`` form)."""
    env: dict[str, str] = {}
    for value in values(dockerfile, "ENV"):
        env.update(word.split("=", 1) for word in shlex.split(value))
    return env


def exec_form(value: str) -> list[str]:
    """An exec-form JSON array as is; a shell-form line as Docker runs it."""
    if value.lstrip().startswith("["):
        words = json.loads(value)
        assert isinstance(words, list)
        return [str(w) for w in words]
    return ["/bin/sh", "-c", value]


def default_process(dockerfile: Path) -> tuple[list[str], list[str]]:
    """The image's ENTRYPOINT and CMD (the last of each counts, as in Docker)."""
    entrypoint = values(dockerfile, "ENTRYPOINT")
    cmd = values(dockerfile, "CMD")
    return (
        exec_form(entrypoint[-1]) if entrypoint else [],
        exec_form(cmd[-1]) if cmd else [],
    )


def healthcheck(dockerfile: Path) -> list[str]:
    """The HEALTHCHECK's command, its options dropped."""
    (check,) = values(dockerfile, "HEALTHCHECK")
    return exec_form(check.partition("CMD")[2].strip())


def shell_commands(line: str) -> Iterator[list[str]]:
    """The simple commands of a shell line, split at ``&&``, ``||``, ``;`` and ``|``."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    words: list[str] = []
    for token in lexer:
        if set(token) <= set(";&|"):
            if words:
                yield words
            words = []
        else:
            words.append(token)
    if words:
        yield words


def hotpool_argvs(argv: list[str]) -> Iterator[list[str]]:
    """The arguments of every ``hotpool`` (or ``python -m hotpool``) that ``argv`` runs."""
    if argv[:2] == ["/bin/sh", "-c"]:
        for words in shell_commands(argv[2]):
            yield from hotpool_argvs(words)
    elif argv and Path(argv[0]).name == "hotpool":
        yield argv[1:]
    elif argv[1:3] == ["-m", "hotpool"]:
        yield argv[3:]


def dockerfile_argvs(dockerfile: Path) -> list[list[str]]:
    """Every hotpool command a Dockerfile runs: at build (RUN), as its process, as its check."""
    found = [a for v in values(dockerfile, "RUN") for a in hotpool_argvs(exec_form(v))]
    entrypoint, cmd = default_process(dockerfile)
    found += hotpool_argvs(entrypoint + cmd)
    if values(dockerfile, "HEALTHCHECK"):
        found += hotpool_argvs(healthcheck(dockerfile))
    return found


def check_cli(argv: list[str]) -> None:
    """Parse ``hotpool ARGV`` as the CLI does, without running anything: an unknown command
    or option, a bad choice or a missing argument fails the test."""
    command: click.Command = hotpool_cli
    rest = list(argv)
    while isinstance(command, click.Group):
        if not rest:
            pytest.fail(f"`hotpool {shlex.join(argv)}` stops at a command group")
        name = rest.pop(0)
        sub = command.commands.get(name)
        if sub is None:
            pytest.fail(f"`hotpool {shlex.join(argv)}`: the CLI has no {name!r}")
        command = sub
    try:
        with command.make_context(command.name or "", rest):  # parses; the callback never runs
            pass
    except click.UsageError as exc:
        pytest.fail(f"`hotpool {shlex.join(argv)}`: {exc.format_message()}")


# --- docker-compose.yml ------------------------------------------------------------------

_VARIABLE = re.compile(
    r"\$(?:\$|\{(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|(?P<bare>[A-Za-z_]\w*))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable interpolation (``$$``, ``${VAR}``, ``${VAR:-default}``,
    ``${VAR-default}``, ``${VAR:?error}``, ``${VAR:+other}``) over every string value. A
    variable with no value and no default fails: the file must work without a .env."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op") or "", m.group("arg") or ""
        value = env.get(name)
        empty = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return arg if empty else str(value)
        if op.endswith("+"):
            return "" if empty else arg
        assert not empty, f"${{{name}}} has no value and no default"
        return str(value)

    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        return _VARIABLE.sub(one, value)
    return value


def load_compose(env: Mapping[str, str] | None = None) -> Doc:
    """The compose file as ``docker compose config`` sees it: YAML merged, interpolated."""
    loaded = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env or {})
    assert isinstance(loaded, dict)
    return loaded


def compose_environment(service: Doc) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def service_dockerfile(service: Doc) -> Path | None:
    """The Dockerfile a service builds its image from, if it builds one."""
    build = service.get("build")
    if build is None:
        return None
    context = DEPLOY / (build if isinstance(build, str) else build.get("context", "."))
    name = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
    return (context / name).resolve()


def service_process(service: Doc) -> list[str]:
    """What a service's container runs: compose's entrypoint and command over the image's."""
    dockerfile = service_dockerfile(service)
    entrypoint, cmd = default_process(dockerfile) if dockerfile else ([], [])
    if "entrypoint" in service:
        entrypoint, cmd = _words(service["entrypoint"]), []
    if "command" in service:
        cmd = _words(service["command"])
    return entrypoint + cmd


def _words(value: str | list[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def deploy_yaml(path: str) -> Doc:
    loaded = yaml.safe_load((DEPLOY / path).read_text())
    assert isinstance(loaded, dict)
    return loaded


# --- Kubernetes --------------------------------------------------------------------------


def load_manifests() -> list[Doc]:
    """Every object of every manifest in deploy/k8s (the opt-in ServiceMonitor included)."""
    docs: list[Doc] = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find(manifests: list[Doc], kind: str, name: str | None = None) -> Doc:
    """The one object of ``kind`` (and ``name``)."""
    (found,) = [m for m in manifests if m["kind"] == kind and name in (None, m["metadata"]["name"])]
    return found


def walk(value: Any) -> Iterator[Doc]:
    """Every mapping inside ``value``, itself included."""
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from walk(v)
