from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    build_manifest,
    read_manifest,
    write_manifest,
)


def make_snapshot(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (folder / "tokenizer").mkdir(exist_ok=True)
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    return folder


def test_build_lists_every_file_sorted_with_size_and_sha256(tmp_path: Path) -> None:
    folder = make_snapshot(tmp_path / "snap")
    (folder / MANIFEST_NAME).write_text("stale")  # never lists itself

    manifest = build_manifest(folder, architecture="llama", dtype="bf16")

    assert [f.path for f in manifest.files] == [
        "config.json",
        "model.safetensors",
        "tokenizer/tokenizer.json",
    ]
    weights = manifest.files[1]
    assert weights.size == 10240
    assert weights.sha256 == hashlib.sha256(bytes(range(256)) * 40).hexdigest()
    assert manifest.total_bytes == 18 + 10240 + 2
    assert (manifest.format_version, manifest.architecture, manifest.dtype) == (
        FORMAT_VERSION,
        "llama",
        "bf16",
    )


def test_digest_is_stable_and_independent_of_location(tmp_path: Path) -> None:
    first = build_manifest(make_snapshot(tmp_path / "a"), "llama", "bf16")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    second = build_manifest(tmp_path / "b", "llama", "bf16")

    assert first == second
    assert first.digest == second.digest
    assert len(first.digest) == 64


def test_digest_changes_when_a_file_or_the_dtype_changes(tmp_path: Path) -> None:
    folder = make_snapshot(tmp_path / "snap")
    before = build_manifest(folder, "llama", "bf16")
    (folder / "config.json").write_text('{"hidden_size": 9}')  # same size, new bytes

    after = build_manifest(folder, "llama", "bf16")

    assert after.digest != before.digest
    assert build_manifest(folder, "llama", "fp32").digest != after.digest


def test_written_manifest_round_trips_and_shows_the_digest(tmp_path: Path) -> None:
    folder = make_snapshot(tmp_path / "snap")
    manifest = build_manifest(folder, "llama", "bf16")

    path = write_manifest(folder, manifest)

    assert json.loads(path.read_text())["digest"] == manifest.digest
    assert read_manifest(path) == manifest
    assert read_manifest(folder) == manifest
    assert read_manifest(path.read_bytes()) == manifest
    assert Manifest.from_json(manifest.to_json()).digest == manifest.digest


def test_reading_an_edited_manifest_fails_on_the_digest(tmp_path: Path) -> None:
    folder = make_snapshot(tmp_path / "snap")
    manifest = build_manifest(folder, "llama", "bf16")
    data = manifest.to_json()
    data["dtype"] = "fp32"

    with pytest.raises(SnapshotError, match="digest mismatch"):
        read_manifest(json.dumps(data).encode())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format_version": 99}, "unsupported manifest format_version 99"),
        ({"files": [{"path": "../escape", "size": 1, "sha256": "0" * 64}]}, "relative path"),
        ({"files": [{"path": "/etc/passwd", "size": 1, "sha256": "0" * 64}]}, "relative path"),
        ({"files": [{"path": "a", "size": 1, "sha256": "nothex"}]}, "bad sha256"),
        ({"total_bytes": 5}, "total_bytes"),
        ({"architecture": None, "files": "x"}, "malformed manifest"),
    ],
)
def test_invalid_manifests_are_rejected(change: dict[str, object], message: str) -> None:
    data: dict[str, object] = {
        "format_version": FORMAT_VERSION,
        "architecture": "llama",
        "dtype": "bf16",
        "files": [{"path": "a", "size": 1, "sha256": "0" * 64}],
        "total_bytes": 1,
        **change,
    }
    with pytest.raises(SnapshotError, match=message):
        Manifest.from_json(data)


def test_missing_or_garbled_manifest_is_a_snapshot_error(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="no manifest"):
        read_manifest(tmp_path)
    with pytest.raises(SnapshotError, match="not valid JSON"):
        read_manifest(b"{nope")
