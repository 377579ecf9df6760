"""A GGUF's tensors as HF transformers weights: dequantized, renamed, and undone where llama.cpp
changed them on the way in (Llama's q/k row order, Gemma's ``1 + w`` norms, experts stacked
into one tensor)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.gguf_arch import Family

Q = GGMLQuantizationType
# The block types whose dequantization is checked against HF's (tests/worker/
# test_gguf_quants.py); others (IQ*, TQ*, MXFP4) gguf may read, but nothing here vouches for.
SUPPORTED_TYPES = frozenset(
    {
        Q.F32, Q.F16, Q.BF16,
        Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
        Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    }
)  # fmt: skip
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, family: Family) -> str:
    """The HF parameter name of the GGUF tensor ``gguf_name``; for a stack of experts, with
    ``{e}`` where the expert's index goes."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in family.block_names:
        raise SnapshotError(
            f"GGUF tensor {gguf_name!r} has no {family.hf_architecture} counterpart"
        )
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{family.block_names[part]}.{kind}"


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (as HF's ``reverse_permute_weights`` does).

    llama.cpp's converter reorders each head's rows so rotary pairs are adjacent (rows
    ``2i, 2i+1``, GPT-J style); HF Llama pairs row ``i`` with ``i + head_dim/2``
    (``rotate_half``). Per head, GGUF row ``2i + j`` holds HF row ``j * head_dim/2 + i``.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantized(tensor: Any) -> np.ndarray:
    """A GGUF tensor's values in float32, torch's dim order; refuses block types not vouched for."""
    kind = GGMLQuantizationType(tensor.tensor_type)
    if kind not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
        raise SnapshotError(
            f"GGUF tensor {tensor.name!r} is stored as {kind.name}, which hotpool cannot "
            f"dequantize yet (supported: {names})"
        )
    values = dequantize(tensor.data, kind)
    # GGUF lists dims fastest-first; dequantized arrays are already row-major (torch order).
    expected = tuple(int(d) for d in reversed(tensor.shape))
    if values.shape != expected:
        raise SnapshotError(f"{tensor.name}: dequantized shape {values.shape} != {expected}")
    return np.asarray(values, dtype=np.float32)


def config_tensors(reader: GGUFReader, family: Family) -> dict[str, np.ndarray]:
    """The GGUF tensors that hold config values (:attr:`Family.config_tensors`), dequantized."""
    return {t.name: dequantized(t) for t in reader.tensors if t.name in family.config_tensors}


def hf_tensors(
    reader: GGUFReader, family: Family, config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every weight of the GGUF under its HF name, in ``dtype``; no ``lm_head`` when tied.
    A stack of experts ``[experts, out, in]`` becomes one ``[out, in]`` tensor per expert."""
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in family.config_tensors:
            continue
        name = hf_name(t.name, family)
        values = dequantized(t)
        if "{e}" in name:
            experts = config.get("num_experts")
            if values.ndim != 3 or values.shape[0] != experts:
                raise SnapshotError(f"{t.name}: shape {values.shape} is not {experts} experts")
            for e, expert in enumerate(values):
                tensors[name.format(e=e)] = _torch(expert, dtype)
            continue
        if family.permute_qk and ".attn_q." in t.name:
            values = unpermute_rotary(values, config["num_attention_heads"])
        elif family.permute_qk and ".attn_k." in t.name:
            values = unpermute_rotary(values, config["num_key_value_heads"])
        if family.norm_offset and "norm.weight" in t.name:
            values = values - np.float32(family.norm_offset)
        tensors[name] = _torch(values, dtype)
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    return tensors


def _torch(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    # A copy: F32 tensors are read-only views of the memory-mapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32, order="C")).to(dtype)
