"""The Dockerfiles and the compose file, checked without a Docker engine (these machines have
none): the compose file against the Compose Specification's JSON schema and its references,
the Dockerfiles' parsed instructions, and every hotpool command they run against the CLI."""

from __future__ import annotations

import importlib.resources
import json
import re
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import jsonschema
import pytest
from deploy_files import (
    CONTROL_PLANE,
    DEPLOY,
    REPO,
    WORKER,
    Doc,
    build_args,
    check_cli,
    compose_environment,
    deploy_yaml,
    dockerfile_argvs,
    find,
    healthcheck,
    hotpool_argvs,
    hotpool_env_names,
    image_env,
    load_compose,
    load_manifests,
    service_dockerfile,
    service_process,
    shell_commands,
    values,
    walk,
)
from packaging.requirements import Requirement


@pytest.fixture(scope="module")
def compose() -> Doc:
    return load_compose()


# --- Dockerfiles -------------------------------------------------------------------------


def test_dockerfiles_run_only_commands_the_cli_has() -> None:
    for dockerfile in (CONTROL_PLANE, WORKER):
        argvs = dockerfile_argvs(dockerfile)
        assert ["serve"] in argvs, f"{dockerfile.name} should serve by default"
        for argv in argvs:
            check_cli(argv)


def test_the_cli_check_catches_what_it_should() -> None:
    check_cli(["db", "upgrade", "--revision", "head"])
    for bad in (["db"], ["dbx", "upgrade"], ["serve", "--hots", "0.0.0.0"], ["models", "pull"]):
        with pytest.raises(pytest.fail.Exception):
            check_cli(bad)


def test_images_agree_on_python_ray_and_user() -> None:
    cp, worker = build_args(CONTROL_PLANE), build_args(WORKER)
    # Ray refuses a driver (the control plane) and nodes of different Ray or Python versions.
    assert cp["PYTHON_VERSION"] == worker["PYTHON_VERSION"]
    assert cp["RAY_VERSION"] == worker["RAY_VERSION"]
    assert values(CONTROL_PLANE, "FROM") == ["python:${PYTHON_VERSION}-slim-bookworm"]
    assert any('"ray[client]==${RAY_VERSION}"' in v for v in values(CONTROL_PLANE, "RUN"))
    assert any('"ray[default]==${RAY_VERSION}"' in v for v in values(WORKER, "RUN"))
    assert any('install "${PYTHON_VERSION}"' in v for v in values(WORKER, "RUN"))
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", worker["CUDA_IMAGE"])
    # The images' Ray is one pyproject's Ray extra allows (the tests' Ray).
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for group in extras.get("optional-dependencies", {}).values():
        for req in map(Requirement, group):
            if req.name == "ray":
                assert req.specifier.contains(cp["RAY_VERSION"]), str(req)
    for dockerfile in (CONTROL_PLANE, WORKER):
        assert values(dockerfile, "USER") == ["10001:10001"]  # the uid k8s/ runs as
        # The same home on both: the control plane forwards its HOTPOOL_* to the workers.
        assert image_env(dockerfile)["HOTPOOL_HOME"] == "/var/lib/hotpool"


def requirements_printed_by(dockerfile: Path) -> list[str]:
    """Runs the ``python -c`` of the RUN that reads pyproject.toml, as the build would."""
    (run,) = [v for v in values(dockerfile, "RUN") if "tomllib" in v]
    (words,) = [w for w in shell_commands(run) if w[:2] == ["python", "-c"]]
    out = subprocess.run(
        [sys.executable, "-c", words[2]], cwd=REPO, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_control_plane_image_installs_every_dependency_but_torch() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = [d for d in deps if re.match(r"torch(?![\w.-])", d)]
    assert torch, "pyproject.toml no longer names torch: revisit deploy/Dockerfile's filter"
    assert requirements_printed_by(CONTROL_PLANE) == [d for d in deps if d not in torch]
    assert requirements_printed_by(WORKER) == deps


def test_images_copy_every_package_folder() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    folders |= set(pyproject["build-system"].get("backend-path", []))  # `pip install .` needs it
    for dockerfile in (CONTROL_PLANE, WORKER):
        copied = {v.split()[0] for v in values(dockerfile, "COPY") if not v.startswith("--")}
        assert copied == folders | {"pyproject.toml"}, dockerfile.name
        # BuildKit's ignore file beside the Dockerfile is an allowlist: it must let them in.
        ignore = Path(f"{dockerfile}.dockerignore").read_text().split()
        assert {f"!{f}" for f in folders | {"pyproject.toml", "README.md"}} <= set(ignore)


class _Recorder(BaseHTTPRequestHandler):
    paths: list[str] = []  # the paths asked for, across requests

    def do_GET(self) -> None:
        self.paths.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_control_plane_healthcheck_probes_healthz() -> None:
    probe = healthcheck(CONTROL_PLANE)
    assert probe[0] == "python"  # the slim image has no curl
    argv = [sys.executable, *probe[1:]]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    env = {"HOTPOOL_PORT": str(server.server_address[1]), "PATH": "/usr/bin:/bin"}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert subprocess.run(argv, env=env, timeout=30).returncode == 0
        assert _Recorder.paths == ["/healthz"]
    finally:
        server.shutdown()
        server.server_close()
    # Nothing listening: the check fails, and Docker marks the container unhealthy.
    assert subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode != 0


# --- docker-compose.yml ------------------------------------------------------------------


def compose_schema() -> Doc:
    # The Compose Specification's schema as check-jsonschema vendors it (with its licence).
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads((vendor / "compose-spec.json").read_text())
    assert isinstance(schema, dict)
    return schema


def test_compose_file_matches_the_compose_specification(compose: Doc) -> None:
    validator = jsonschema.Draft202012Validator(compose_schema())
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []
    # The schema is strict enough to catch a misspelt key.
    broken = {**compose, "services": {**compose["services"], "x": {"image": "a", "dependson": []}}}
    assert not validator.is_valid(broken)


def test_compose_references_resolve(compose: Doc) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dep in service.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown {dep}"
        dockerfile = service_dockerfile(service)
        if dockerfile is not None:
            assert dockerfile.is_file(), f"{name}: no {dockerfile}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"


def test_compose_runs_only_commands_the_cli_has(compose: Doc) -> None:
    ran = []
    for service in compose["services"].values():
        for argv in hotpool_argvs(service_process(service)):
            check_cli(argv)
            ran.append(argv[:2])
    assert ["db", "upgrade"] in ran and ["serve", "--deploy"] in ran and ["models", "pull"] in ran


def test_compose_wires_the_parts_together(compose: Doc) -> None:
    s = compose["services"]
    cp, env = s["hotpool"], compose_environment(s["hotpool"])
    # PostgreSQL is migrated before the control plane serves it (README: db upgrade first).
    assert service_process(s["migrate"]) == ["hotpool", "db", "upgrade"]
    assert cp["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    url = env["HOTPOOL_DATABASE_URL"]
    assert url == compose_environment(s["migrate"])["HOTPOOL_DATABASE_URL"]
    assert url.startswith("postgresql+psycopg2://") and urlsplit(url).hostname in s
    # Workers live on the Ray node, and reach the control plane back by its service name.
    assert env["HOTPOOL_BACKEND"] == "ray"
    ray = urlsplit(env["HOTPOOL_RAY_ADDRESS"])
    assert ray.scheme == "ray" and ray.hostname in s
    assert f"--ray-client-server-port={ray.port}" in s[ray.hostname]["command"]
    assert urlsplit(env["HOTPOOL_CONTROL_PLANE_URL"]).hostname == "hotpool"
    (gpu,) = s[ray.hostname]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["count"] == 1
    # The bucket made at start is the one the snapshot is pushed to and deployed from.
    pull = service_process(s["models"])
    bucket = urlsplit(pull[pull.index("--store") + 1]).hostname
    assert f"mc mb --ignore-existing hotpool/{bucket}" in " ".join(service_process(s["minio-init"]))
    assert f"s3://{bucket}/snapshots/smollm2" in " ".join(cp["command"])
    # Prometheus scrapes the control plane by service name; Grafana finds it and the board.
    assert (
        "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
        in (s["prometheus"]["volumes"])
    )
    (job,) = deploy_yaml("prometheus/prometheus.yml")["scrape_configs"]
    (targets,) = job["static_configs"]
    assert targets["targets"] == ["hotpool:8000"] and "8000:8000" in cp["ports"]
    provider = deploy_yaml("grafana/provisioning/dashboards/hotpool.yml")["providers"][0]
    board = f"./grafana/hotpool.json:{provider['options']['path']}/hotpool.json:ro"
    assert board in s["grafana"]["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in s["grafana"]["volumes"]
    (datasource,) = deploy_yaml("grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert urlsplit(datasource["url"]).hostname in s


# --- across deploy/ ----------------------------------------------------------------------


def test_deploy_files_set_only_variables_hotpool_reads(compose: Doc) -> None:
    set_by: dict[str, set[str]] = {d.name: set(image_env(d)) for d in (CONTROL_PLANE, WORKER)}
    for name, service in compose["services"].items():
        set_by[f"compose {name}"] = set(compose_environment(service))
    for m in load_manifests():
        names = {d["name"] for d in walk(m) if "name" in d and ("value" in d or "valueFrom" in d)}
        if m["kind"] == "ConfigMap" and m["metadata"]["name"] == "hotpool-config":
            names |= set(m["data"])
        set_by[f"{m['kind']} {m['metadata']['name']}"] = names
    known = hotpool_env_names()
    unknown = {
        where: sorted(n for n in names if n.startswith("HOTPOOL_") and n not in known)
        for where, names in set_by.items()
    }
    assert {where: names for where, names in unknown.items() if names} == {}
    assert sum("HOTPOOL_BACKEND" in names for names in set_by.values()) >= 2  # compose and k8s


def test_ray_start_parameters_are_rays(compose: Doc) -> None:
    scripts = pytest.importorskip("ray.scripts.scripts")  # an optional extra: hotpool[ray]
    ray_cli: click.Group = scripts.cli

    def check(argv: list[str]) -> None:
        command = ray_cli.commands[argv[0]]
        with command.make_context(argv[0], argv[1:]):  # parses; nothing starts
            pass

    worker = compose["services"]["worker"]
    check(service_process(worker)[1:])
    check(worker["healthcheck"]["test"][2:])
    # KubeRay turns rayStartParams into `ray start --KEY=VALUE` (plus flags of its own).
    ray = find(load_manifests(), "RayCluster")
    head = ray["spec"]["headGroupSpec"]["rayStartParams"]
    check(["start", "--head", *(f"--{k}={v}" for k, v in head.items())])
    for group in ray["spec"]["workerGroupSpecs"]:
        params = group["rayStartParams"]
        check(["start", "--address=head:6379", *(f"--{k}={v}" for k, v in params.items())])
    with pytest.raises(click.UsageError):
        check(["start", "--num-gpu=1"])  # the check itself catches a misspelt parameter
