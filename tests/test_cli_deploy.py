"""``hotpool deploy`` against a real control plane (uvicorn in a thread, no worker): a bare
snapshot name means the same snapshot to the CLI and to the API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cli_runner import invoke
from click.testing import CliRunner
from snapshot_folders import snapshot_folder
from uvicorn_thread import uvicorn_in_thread

from hotpool.billing.db import Database
from hotpool.platform.app import build_services, create_app
from hotpool.pool.local import LocalProcessBackend, LocalWorkerConfig
from hotpool.settings import load_settings


@pytest.fixture
def server(home: Path) -> Iterator[str]:
    """The control plane of the CLI's HOTPOOL_HOME, serving; its base URL."""
    settings = load_settings({"HOTPOOL_HOME": str(home), "HOTPOOL_WARM_WORKERS": "0"})
    db = Database(settings.database_url)
    db.upgrade()
    backend = LocalProcessBackend(
        LocalWorkerConfig("http://127.0.0.1:9", "token", settings.cache_dir, home / "logs")
    )
    try:
        with uvicorn_in_thread(create_app(build_services(settings, db, backend, "token")),
                               lifespan="on") as url:  # fmt: skip
            yield url
    finally:
        db.dispose()


def test_a_name_deploys_the_snapshot_the_api_reads_it_as(
    run: CliRunner, home: Path, server: str
) -> None:
    tiny = snapshot_folder(home / "objects" / "snapshots" / "tiny")  # where `models pull` puts it
    result = invoke(run, "deploy", "by-cli", "--snapshot", "tiny", "--url", server)
    assert result.exit_code == 0, result.output
    r = httpx.post(f"{server}/v1/deployments", json={"name": "by-api", "snapshot_uri": "tiny"})
    assert r.status_code == 201, r.text
    by_cli = httpx.get(f"{server}/v1/deployments/by-cli").json()["snapshot_uri"]
    assert by_cli == r.json()["snapshot_uri"] == f"file://{tiny}"

    # Deploying the name again is the same snapshot: no new version.
    again = invoke(run, "deploy", "by-api", "--snapshot", "tiny", "--url", server)
    assert again.exit_code == 0, again.output
    assert f"by-api already serves file://{tiny} (version 1)" in again.output


def test_a_name_in_no_store_is_refused_by_both(run: CliRunner, home: Path, server: str) -> None:
    snapshot_folder(home / "objects" / "snapshots" / "tiny")
    result = invoke(run, "deploy", "x", "--snapshot", "smollm2-fp32", "--url", server)
    assert result.exit_code == 1
    missing = home / "objects" / "snapshots" / "smollm2-fp32"
    assert f"no snapshot at file://{missing}" in result.stderr, result.stderr
    r = httpx.post(f"{server}/v1/deployments", json={"name": "x", "snapshot_uri": "smollm2-fp32"})
    assert r.status_code == 400, r.text
    assert f"file://{home / 'objects' / 'snapshots'}" in r.json()["error"]["message"]
    assert httpx.get(f"{server}/v1/deployments").json()["data"] == []


def test_quantization_is_set_shown_and_listed_per_version(
    run: CliRunner, home: Path, server: str
) -> None:
    tiny = snapshot_folder(home / "objects" / "snapshots" / "tiny")
    result = invoke(run, "deploy", "q", "--snapshot", "tiny", "--quantization", "int8",
                    "--url", server)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"deployed q from file://{tiny} (int8 quantization)"
    engine = httpx.get(f"{server}/v1/deployments/q").json()["engine"]
    assert engine["quantization"] == "int8"
    # Without the flag it stays; with another value it is a new version.
    again = invoke(run, "deploy", "q", "--snapshot", "tiny", "--url", server)
    assert "q already serves" in again.output and "(int8 quantization) (version 1)" in again.output
    back = invoke(run, "deploy", "q", "--snapshot", "tiny", "--quantization", "none",
                  "--url", server)  # fmt: skip
    assert back.output.strip() == f"rolled out version 2 of q from file://{tiny}"
    listed = invoke(run, "versions", "q", "--url", server)
    assert listed.exit_code == 0, listed.output
    header, v1, v2 = listed.output.splitlines()[:3]
    assert "quantization" in header.split()
    assert v1.split()[:2] == ["1", "previous"] and "int8" in v1.split()
    assert v2.split()[:2] == ["2", "stable"] and "none" in v2.split()

    # The server's 400 reaches the user: this snapshot keeps no GGUF blocks.
    gguf = invoke(run, "deploy", "q", "--snapshot", "tiny", "--quantization", "gguf",
                  "--url", server)  # fmt: skip
    assert gguf.exit_code == 1
    assert "keeps no GGUF blocks" in gguf.stderr, gguf.stderr
    bad = invoke(run, "deploy", "q", "--snapshot", "tiny", "--quantization", "int4")
    assert bad.exit_code == 2 and "'int4' is not one of 'none', 'int8', 'gguf'" in bad.stderr
