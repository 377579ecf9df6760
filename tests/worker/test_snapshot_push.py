"""Pushing a Hugging Face-format folder: which files go, the dtype it records, and clear
errors for folders that are not snapshots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.manifest import MANIFEST_NAME, read_manifest
from hotpool.worker.snapshot.push import folder_manifest, push_folder


def make_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (folder / "tokenizer.json").write_text("{}")
    # Mostly bf16 bytes in two shards, with a small fp32 norm: the snapshot is bf16.
    save_file({"a": torch.zeros(64, 64, dtype=torch.bfloat16)}, folder / "model-1.safetensors")
    save_file(
        {"b": torch.zeros(32, 64, dtype=torch.bfloat16), "norm": torch.zeros(64)},
        folder / "model-2.safetensors",
    )
    (folder / "model.safetensors.index.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"old checkpoint")
    (folder / ".git").mkdir()
    return folder


def test_a_folder_pushes_its_snapshot_files_only(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "hf")

    manifest, skipped = push_folder(folder, f"file://{tmp_path}/store/snap")

    assert [f.path for f in manifest.files] == [
        "config.json",
        "model-1.safetensors",
        "model-2.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    assert skipped == [".git", "pytorch_model.bin"]
    assert (manifest.architecture, manifest.dtype) == ("qwen2", "bf16")
    assert read_manifest(tmp_path / "store" / "snap") == manifest
    assert not (folder / MANIFEST_NAME).exists()  # the source folder is left as it was


def test_fp16_weights_are_recorded_as_fp16(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "hf")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file({"w": torch.zeros(8, dtype=torch.float16)}, folder / "model.safetensors")
    assert folder_manifest(folder)[0].dtype == "fp16"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: (f / "config.json").unlink(), "has no config.json"),
        (lambda f: (f / "config.json").write_text("{"), "config.json is not valid JSON"),
        (lambda f: (f / "config.json").write_text("{}"), "has no model_type"),
        (lambda f: (f / "tokenizer.json").unlink(), "has no tokenizer.json"),
        (lambda f: [p.unlink() for p in f.glob("*.safetensors")], "has no *.safetensors"),
        (
            lambda f: (f / "model-1.safetensors").write_bytes(b"not a safetensors file"),
            "model-1.safetensors is not a safetensors file",
        ),
    ],
    ids=["no-config", "bad-json", "no-model-type", "no-tokenizer", "no-weights", "bad-weights"],
)
def test_folders_that_are_not_snapshots_are_named(
    tmp_path: Path, damage: object, message: str
) -> None:
    folder = make_folder(tmp_path / "hf")
    damage(folder)  # type: ignore[operator]
    with pytest.raises(SnapshotError) as info:
        folder_manifest(folder)
    assert message in str(info.value)
