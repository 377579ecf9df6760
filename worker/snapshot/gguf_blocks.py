"""A GGUF's quantized blocks kept as they are, for deployments with ``quantization: gguf``.

The converter writes dequantized weights for every deployment; with ``keep_blocks`` it also
writes the linear layers' blocks, byte for byte as the file stores them, under their HF
names (``gguf/blocks.safetensors``: ``uint8 [out_features, row_bytes]`` each, the block type
in the file's metadata). Rows are independent runs of blocks, so what llama.cpp did to rows
on the way in (Llama's q/k order) is undone on the blocks exactly. Only the block types the
quantized kernels serve are kept (``SERVED_TYPES``); a layer of another type (Q6_K, say) is
served from its dequantized weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors import safe_open
from safetensors.torch import save_file

from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.gguf_arch import Family
from hotpool.worker.snapshot.gguf_tensors import hf_name, unpermute_rotary

Q = GGMLQuantizationType
SERVED_TYPES = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K})  # hotpool.kernels.quant_weight
BLOCKS_FILE = "gguf/blocks.safetensors"
_KINDS_KEY = "hotpool.gguf_kinds"  # metadata: JSON {hf name: block type name}


def hf_blocks(
    reader: GGUFReader, family: Family, config: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The served-type 2-D weights of the GGUF as raw blocks under HF names, and each one's
    block type. Stacked experts stay dequantized (the MoE kernels are dense)."""
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for t in reader.tensors:
        kind = Q(t.tensor_type)
        if kind not in SERVED_TYPES or t.name in family.config_tensors:
            continue
        name = hf_name(t.name, family)
        data = np.asarray(t.data)
        if "{e}" in name or not name.endswith(".weight") or data.ndim != 2:
            continue
        if family.permute_qk and ".attn_q." in t.name:
            data = unpermute_rotary(data, config["num_attention_heads"])
        elif family.permute_qk and ".attn_k." in t.name:
            data = unpermute_rotary(data, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.array(data, dtype=np.uint8, order="C"))
        kinds[name] = kind.name
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
        kinds.pop("lm_head.weight", None)
    return tensors, kinds


def write_blocks(out_dir: Path, tensors: dict[str, torch.Tensor], kinds: dict[str, str]) -> None:
    if not tensors:
        return
    path = out_dir / BLOCKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path, {"format": "pt", _KINDS_KEY: json.dumps(kinds, sort_keys=True)})


def block_kinds(folder: Path) -> dict[str, str]:
    """{HF weight name: block type} of a snapshot folder's kept blocks ({} without any)."""
    path = folder / BLOCKS_FILE
    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), "pt") as f:
            kinds = json.loads((f.metadata() or {})[_KINDS_KEY])
    except (OSError, KeyError, ValueError) as exc:
        raise SnapshotError(f"{path} is not a blocks file hotpool wrote: {exc}") from None
    if not isinstance(kinds, dict) or not all(
        isinstance(v, str) and v in Q.__members__ and Q[v] in SERVED_TYPES for v in kinds.values()
    ):
        raise SnapshotError(f"{path} names block types hotpool does not serve: {kinds}")
    return kinds


def load_blocks(folder: Path, device: str = "cpu") -> dict[str, tuple[str, torch.Tensor]]:
    """{HF weight name: (block type, uint8 blocks)} of a snapshot folder ({} without any)."""
    kinds = block_kinds(folder)
    if not kinds:
        return {}
    with safe_open(str(folder / BLOCKS_FILE), "pt", device=device) as f:
        return {name: (kinds[name], f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118
