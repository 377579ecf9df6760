"""Turn a local model into a snapshot in an object store: a Hugging Face-format folder as it
is, or a llama.cpp GGUF converted on the way (:func:`convert_gguf`)."""

from __future__ import annotations

import json
import struct
import tempfile
from collections import Counter
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from hotpool.worker.snapshot.chat_settings import ChatSettings
from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.gguf import DTYPES, convert_gguf
from hotpool.worker.snapshot.gguf_blocks import block_kinds
from hotpool.worker.snapshot.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    ManifestFile,
    build_manifest,
    hash_file,
)
from hotpool.worker.snapshot.store import push_snapshot

# What a worker reads from a snapshot; anything else in a folder (READMEs, .bin or .gguf
# checkpoints, .git) stays behind.
SNAPSHOT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_SAFETENSORS_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
_MAX_HEADER = 100 << 20


def folder_manifest(folder: Path) -> tuple[Manifest, list[str]]:
    """The manifest of the snapshot files in an HF-format ``folder`` (config.json, weights in
    ``*.safetensors``, tokenizer files), and the names of the files it leaves out.

    The architecture is config.json's ``model_type``; the dtype is the one most weight bytes
    are stored in.
    """
    config = _read_config(folder)
    architecture = config.get("model_type")
    if not isinstance(architecture, str) or not architecture:
        raise SnapshotError(f"{folder / 'config.json'} has no model_type")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise SnapshotError(
            f"{folder} has no *.safetensors weights (convert .bin checkpoints to safetensors)"
        )
    if not (folder / "tokenizer.json").is_file():
        raise SnapshotError(f"{folder} has no tokenizer.json")
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    keep = [n for n in names if any(fnmatch(n, pattern) for pattern in SNAPSHOT_PATTERNS)]
    skipped = [
        n for n in sorted(p.name for p in folder.iterdir()) if n not in keep and n != MANIFEST_NAME
    ]
    files = []
    for name in keep:
        size, sha = hash_file(folder / name)
        files.append(ManifestFile(path=name, size=size, sha256=sha))
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        architecture=architecture,
        dtype=weights_dtype(weights),
        files=tuple(files),
        total_bytes=sum(f.size for f in files),
    )
    return manifest, skipped


def push_folder(folder: Path, uri: str) -> tuple[Manifest, list[str]]:
    """Push the snapshot files of an HF-format folder to ``uri`` (nothing is written into the
    folder); returns the manifest and the names of the files left out."""
    manifest, skipped = folder_manifest(folder)
    return push_snapshot(folder, uri, manifest), skipped


def push_gguf(
    gguf_path: Path,
    uri: str,
    dtype: str = "bf16",
    chat: ChatSettings | None = None,
    keep_blocks: bool = False,
    kind: str | None = None,
    serving: dict[str, Any] | None = None,
) -> Manifest:
    """Convert a GGUF to a snapshot with ``dtype`` weights and push it to ``uri``; ``chat``
    supplies what the GGUF lacks (see :class:`ChatSettings`); ``keep_blocks`` keeps the
    quantized blocks too, for ``quantization: gguf`` (the manifest lists their types).
    ``kind`` and ``serving``: what the manifest says of the model (base or instruct) and of
    its deployments' default settings (a catalog model's; None for a GGUF pushed as is)."""
    if dtype not in DTYPES:
        raise SnapshotError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    with tempfile.TemporaryDirectory(prefix="hotpool-convert-") as tmp:
        folder = Path(tmp)
        try:
            convert_gguf(gguf_path, folder, dtype, chat, keep_blocks)
        except (ValueError, KeyError, IndexError, struct.error) as exc:
            # gguf's reader raises these for files that are not GGUF or are truncated.
            raise SnapshotError(f"{gguf_path} is not a GGUF file hotpool can read: {exc}") from None
        architecture = str(_read_config(folder).get("model_type", "llama"))
        quantized = tuple(sorted(set(block_kinds(folder).values())))
        manifest = build_manifest(folder, architecture, dtype, quantized, kind, serving)
        return push_snapshot(folder, uri, manifest)


def weights_dtype(paths: list[Path]) -> str:
    """The dtype most bytes of these safetensors files are stored in: bf16, fp16, fp32, or the
    safetensors name in lower case (``f8_e4m3``) for others."""
    bytes_by_dtype: Counter[str] = Counter()
    for path in paths:
        for name, info in _safetensors_header(path).items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                bytes_by_dtype[info["dtype"]] += end - start
    if not bytes_by_dtype:
        raise SnapshotError(f"{paths[0].parent} holds no tensors in its *.safetensors files")
    dtype = bytes_by_dtype.most_common(1)[0][0]
    return _SAFETENSORS_DTYPES.get(dtype, dtype.lower())


def _safetensors_header(path: Path) -> dict[str, dict[str, object]]:
    """The JSON header of a safetensors file: an 8-byte little-endian length, then JSON."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        for name, info in header.items():
            if name != "__metadata__":
                _ = info["dtype"], info["data_offsets"][1]
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise SnapshotError(f"{path} is not a safetensors file ({exc})") from None
    return header


def _read_config(folder: Path) -> dict[str, object]:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise SnapshotError(
            f"{folder} has no config.json (a snapshot folder holds config.json, "
            "*.safetensors and tokenizer files)"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SnapshotError(f"{path} is not a JSON object")
    return config
