"""Small snapshot folders and the object-store contract, shared by the snapshot tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from hotpool.worker.snapshot.errors import ObjectNotFoundError
from hotpool.worker.snapshot.manifest import build_manifest, write_manifest
from hotpool.worker.snapshot.store import ObjectStore


@dataclass(frozen=True)
class PulledSnapshot:
    """A snapshot made by ``hotpool models pull``, and what the command printed."""

    folder: Path
    store: str  # the object store's URI it was pulled into
    output: str


def snapshot_folder(folder: Path, weights: bytes = b"w" * 5000, model_type: str = "llama") -> Path:
    """A snapshot folder (config, weights, tokenizer, manifest); not a loadable model."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 8}))
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text('{"model": {}}')
    write_manifest(folder, build_manifest(folder, model_type, "bf16"))
    return folder


def snapshot_bytes(weights: int = 5000, model_type: str = "llama") -> int:
    """What :func:`snapshot_folder` stores, manifest aside."""
    config = json.dumps({"model_type": model_type, "hidden_size": 8})
    return weights + len(config) + len('{"model": {}}')


def check_store_contract(store: ObjectStore, tmp_path: Path) -> None:
    """The :class:`ObjectStore` contract every backend keeps: upload, streamed download,
    prefix listing, existence, prefix deletion, a missing key."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"abc" * 1000)
    for key in ("snaps/a/model.bin", "snaps/a/sub/x.json", "snaps/ab/model.bin"):
        store.upload(src, key)
    chunks: list[bytes] = []
    store.download("snaps/a/model.bin", tmp_path / "out" / "m.bin", chunks.append)

    assert store.get_bytes("snaps/a/model.bin") == b"abc" * 1000
    assert b"".join(chunks) == (tmp_path / "out" / "m.bin").read_bytes() == b"abc" * 1000
    assert store.list("snaps/a/") == ["snaps/a/model.bin", "snaps/a/sub/x.json"]
    assert store.list("snaps/a") == [
        "snaps/a/model.bin",
        "snaps/a/sub/x.json",
        "snaps/ab/model.bin",
    ]
    assert store.exists("snaps/a/model.bin") and not store.exists("snaps/a")
    store.delete_prefix("snaps/a/")
    assert store.list("snaps/") == ["snaps/ab/model.bin"]
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("snaps/a/model.bin")
