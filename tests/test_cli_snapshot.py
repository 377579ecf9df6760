"""``hotpool snapshot push|ls|inspect|verify|rm`` and ``models pull --store``, run in-process
against a file:// store and a real S3-compatible server (moto on loopback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import boto3
import pytest
import torch
from click.testing import CliRunner, Result
from s3_bucket import S3Bucket
from safetensors.torch import save_file

from hotpool.cli import main
from hotpool.worker.snapshot import push as push_module
from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.snapshot.push import folder_manifest


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    # Only this test's settings: the developer's HOTPOOL_* never leak in (the s3 fixture sets
    # its endpoint again through the runner's env).
    for name in [n for n in os.environ if n.startswith("HOTPOOL_")]:
        monkeypatch.delenv(name)
    return CliRunner(env={"HOTPOOL_HOME": str(tmp_path / "home")})


def invoke(runner: CliRunner, *args: str) -> Result:
    return runner.invoke(main, list(args), catch_exceptions=False)


def one_line_error(result: Result, *parts: str) -> None:
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("Error: ")
    for part in parts:
        assert part in lines[-1]


def make_hf_folder(folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    save_file({"w": torch.arange(2048, dtype=dtype).reshape(32, 64)}, folder / "model.safetensors")
    (folder / "tokenizer.json").write_text('{"model": {}}')
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "README.md").write_text("# not part of the snapshot")
    return folder


@pytest.fixture(params=["file", "s3"])
def base(request: pytest.FixtureRequest, tmp_path: Path, runner: CliRunner) -> str:
    """Where snapshots go: a file:// folder, or a prefix in a fresh S3 bucket."""
    if request.param == "file":
        return f"file://{tmp_path}/objects/snapshots"
    bucket: S3Bucket = request.getfixturevalue("s3_bucket")
    runner.env["HOTPOOL_S3_ENDPOINT_URL"] = bucket.endpoint_url
    return bucket.uri("snapshots")


def corrupt(uri: str, name: str) -> None:
    """Flip the first byte of one object of the snapshot at ``uri``, in place."""
    if uri.startswith("file://"):
        path = Path(uri.removeprefix("file://")) / name
        data = path.read_bytes()
        path.write_bytes(bytes([data[0] ^ 1]) + data[1:])
        return
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=os.environ["HOTPOOL_S3_ENDPOINT_URL"])
    data = s3.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read()
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=bytes([data[0] ^ 1]) + data[1:])


def test_push_ls_inspect_verify_rm(runner: CliRunner, base: str, tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "hf")
    expected, _ = folder_manifest(folder)
    uri = f"{base}/tiny"

    pushed = invoke(runner, "snapshot", "push", str(folder), uri)
    assert pushed.exit_code == 0, pushed.output
    assert f"{uri}  llama bf16  4 files" in pushed.stdout
    assert expected.digest in pushed.stdout
    assert "left out (not snapshot files): README.md" in pushed.stderr

    listed = invoke(runner, "snapshot", "ls", base)
    assert listed.exit_code == 0
    assert (
        listed.stdout.splitlines()[1].split()
        == [
            uri,
            "-",  # a folder pushed as is: its maker said nothing of base or instruct
            "llama",
            "bf16",
            *f"{expected.total_bytes / 1e3:.1f} kB".split(),
            "-",  # in no worker's cache on this host
            "-",
            expected.digest[:16],
        ]
    )

    inspected = invoke(runner, "snapshot", "inspect", uri)
    assert inspected.exit_code == 0
    assert json.loads(inspected.stdout) == expected.to_json()

    verified = invoke(runner, "snapshot", "verify", uri)
    assert verified.exit_code == 0, verified.output
    assert [line.split()[:2] for line in verified.stdout.splitlines()[:4]] == [
        ["ok", "config.json"],
        ["ok", "model.safetensors"],
        ["ok", "tokenizer.json"],
        ["ok", "tokenizer_config.json"],
    ]
    assert f"4 files verified, digest {expected.digest}" in verified.stdout

    removed = invoke(runner, "snapshot", "rm", uri)
    assert removed.exit_code == 0
    assert invoke(runner, "snapshot", "ls", base).stderr.startswith("no snapshots under")
    gone = invoke(runner, "snapshot", "inspect", uri)
    assert gone.exit_code == 1
    one_line_error(gone, f"no snapshot at {uri}")


def test_verify_names_the_corrupted_file(runner: CliRunner, base: str, tmp_path: Path) -> None:
    uri = f"{base}/tiny"
    invoke(runner, "snapshot", "push", str(make_hf_folder(tmp_path / "hf")), uri)
    corrupt(uri, "model.safetensors")

    result = invoke(runner, "snapshot", "verify", uri)

    assert result.exit_code == 1
    assert "BAD   model.safetensors: snapshot file 'model.safetensors' failed" in result.stderr
    assert "ok    config.json" in result.stdout
    one_line_error(result, "1 of 4 files", "failed verification: model.safetensors")


def test_bare_names_live_in_the_local_object_store(runner: CliRunner, tmp_path: Path) -> None:
    assert invoke(runner, "snapshot", "push", str(make_hf_folder(tmp_path / "hf")), "tiny")
    local = tmp_path / "home" / "objects" / "snapshots" / "tiny"
    assert (local / "manifest.json").is_file()
    listed = invoke(runner, "snapshot", "ls").stdout
    assert f"file://{local}" in listed
    assert invoke(runner, "snapshot", "verify", "tiny").exit_code == 0

    # A worker on this host caches it: the same bytes, linked, cost the disk nothing more.
    cached = SnapshotCache(tmp_path / "home" / "cache").fetch(f"file://{local}")
    row = invoke(runner, "snapshot", "ls").stdout.splitlines()[1].split()
    size = f"{cached.manifest.total_bytes / 1e3:.1f} kB".split()
    assert row[4:8] == [*size, *size]  # SIZE, then CACHED
    extra = float(row[8]) * {"B": 1, "kB": 1e3}[row[9]]  # CACHE+: its manifest file alone
    assert extra == (local / "manifest.json").stat().st_size


def test_push_a_gguf_converts_it_with_the_chosen_dtype(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = []

    def fake_convert(
        gguf_path: Path, out_dir: Path, dtype: str, chat: object = None, keep_blocks: bool = False
    ) -> None:
        asked.append((gguf_path.name, dtype))
        out_dir.rmdir()
        make_hf_folder(out_dir, torch.float16)

    monkeypatch.setattr(push_module, "convert_gguf", fake_convert)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    uri = f"file://{tmp_path}/objects/snapshots/from-gguf"

    result = invoke(
        runner, "snapshot", "push", str(tmp_path / "model.gguf"), uri, "--dtype", "fp16"
    )

    assert result.exit_code == 0, result.output
    assert asked == [("model.gguf", "fp16")]
    manifest = json.loads(invoke(runner, "snapshot", "inspect", uri).stdout)
    assert (manifest["architecture"], manifest["dtype"]) == ("llama", "fp16")


def test_a_gguf_that_is_not_one_is_a_clear_error(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"\x00" * 64)
    result = invoke(runner, "snapshot", "push", str(tmp_path / "junk.gguf"), "junk")
    assert result.exit_code == 1
    one_line_error(result, "junk.gguf is not a GGUF file")


@pytest.mark.parametrize(
    ("setup", "args", "code", "message"),
    [
        ("empty", ("push", "{tmp}/empty", "x"), 1, "has no config.json"),
        ("hf", ("push", "{tmp}/hf", "x", "--dtype", "fp16"), 2, "--dtype applies to a .gguf"),
        ("hf", ("push", "{tmp}/hf/README.md", "x"), 2, "neither a folder nor a .gguf"),
        ("", ("push", "{tmp}/nowhere", "x"), 2, "does not exist"),
        ("", ("inspect", "http://example.com/x"), 1, "unsupported snapshot URI"),
        ("", ("verify", "file://relative/x"), 1, "three slashes"),
        ("", ("rm", "file:///{tmp}/nothing"), 1, "no snapshot at"),
        # a bare name stays inside the local object store
        ("hf", ("push", "{tmp}/hf", "../escape"), 2, "is neither a snapshot name"),
        ("hf", ("push", "{tmp}/hf", "a/../../b"), 2, "is neither a snapshot name"),
        ("", ("inspect", "../escape"), 2, "is neither a snapshot name"),
        ("hf", ("push", "{tmp}/hf", "with space"), 2, "is neither a snapshot name"),
        # a local target that cannot be written
        ("hf", ("push", "{tmp}/hf", "file:///proc/hotpool-x"), 1, "No such file or directory"),
        ("file", ("push", "{tmp}/hf", "file:///{tmp}/plain/sub"), 1, "Not a directory"),
    ],
    ids=["no-config", "dtype-on-folder", "not-gguf", "missing-src", "scheme", "relative", "rm",
         "dot-dot", "dot-dot-inside", "inspect-dot-dot", "space", "unwritable", "under-a-file"],
)  # fmt: skip
def test_mistakes_are_one_line_with_an_exit_code(
    runner: CliRunner, tmp_path: Path, setup: str, args: tuple[str, ...], code: int, message: str
) -> None:
    if setup in ("hf", "file"):
        make_hf_folder(tmp_path / "hf")
    if setup == "file":
        (tmp_path / "plain").write_text("a file, not a folder")
    elif setup == "empty":
        (tmp_path / "empty").mkdir()
    result = invoke(runner, "snapshot", *(a.format(tmp=tmp_path) for a in args))
    assert result.exit_code == code
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_s3_failures_are_one_line(runner: CliRunner, s3_bucket: S3Bucket, tmp_path: Path) -> None:
    runner.env["HOTPOOL_S3_ENDPOINT_URL"] = s3_bucket.endpoint_url
    folder = make_hf_folder(tmp_path / "hf")

    no_bucket = invoke(runner, "snapshot", "push", str(folder), "s3://no-such-bucket/x")
    assert no_bucket.exit_code == 1
    one_line_error(no_bucket, "S3 bucket 'no-such-bucket' does not exist")

    no_key = invoke(runner, "snapshot", "verify", s3_bucket.uri("snapshots/none"))
    assert no_key.exit_code == 1
    one_line_error(no_key, f"no snapshot at {s3_bucket.uri('snapshots/none')}")

    runner.env["HOTPOOL_S3_ENDPOINT_URL"] = "ftp://nope"
    bad_setting = invoke(runner, "snapshot", "ls", s3_bucket.uri())
    assert bad_setting.exit_code == 2
    assert "HOTPOOL_S3_ENDPOINT_URL='ftp://nope' is invalid" in bad_setting.stderr


def test_models_pull_if_missing_checks_any_store(
    runner: CliRunner, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    runner.env["HOTPOOL_S3_ENDPOINT_URL"] = s3_bucket.endpoint_url
    store = s3_bucket.uri("hotpool")
    invoke(
        runner, "snapshot", "push", str(make_hf_folder(tmp_path / "hf")), f"{store}/snapshots/smol"
    )

    result = invoke(
        runner, "models", "pull", "smollm2", "--store", store, "--name", "smol", "--if-missing"
    )

    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{store}/snapshots/smol is already there; smollm2 is an")


def test_models_pull_of_an_unknown_model_lists_the_catalog(runner: CliRunner) -> None:
    result = invoke(runner, "models", "pull", "llama-9000")
    assert result.exit_code == 1
    one_line_error(result, "unknown model 'llama-9000'", "smollm2", "gemma3-270m")


def test_models_list_shows_the_catalog(runner: CliRunner) -> None:
    result = invoke(runner, "models", "list")
    assert result.exit_code == 0
    names = [line.split()[0] for line in result.stdout.splitlines()]
    assert {"smollm2", "gemma3-270m"} <= set(names)
    assert "Gemma 3 270M" in result.stdout
