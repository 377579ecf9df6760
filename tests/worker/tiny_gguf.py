"""Tiny random-weight GGUF files of each architecture the converter knows, written with the
``gguf`` package's own writer, so converter and HF's GGUF loader can be compared in seconds."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

# Rows of 256 values, so that every block type (K-quants hold 256 per block) fits.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 256, 6
# Qwen3-MoE: 4 experts, 2 per token. HF's GGUF loader does not read the experts' width
# (expert_feed_forward_length) and keeps Qwen3MoeConfig's 768, so the tiny files use that.
EXPERTS, EXPERTS_USED, EXPERT_FFN = 4, 2, 768
# Phi-3's LongRoPE: trained on 64 positions, stretched to the file's 256 (factor 4).
LONGROPE_ORIGINAL, LONGROPE_CONTEXT = 64, 256
# Phi-3 mini 4k: no LongRoPE, its context is its original one (HF's default, 4096).
PHI3_CONTEXT = 4096
Q = GGMLQuantizationType
QUANT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Byte offsets of the float16 scales in each block type's layout (ggml-common.h).
_F16_AT = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
}  # fmt: skip
_BYTE, _CONTROL, _USER, _NORMAL, _UNKNOWN = 6, 3, 4, 1, 2

# Pieces of a small SentencePiece vocabulary, best first ("▁" is the space).
SP_PIECES = [
    "▁", "e", "t", "h", "l", "o", "a", "n", "i", "s", "r", "d", "w", "c", "u", "m",
    "▁t", "he", "▁the", "ll", "llo", "▁he", "▁hello", "or", "ld", "▁w", "▁wor", "▁world",
    "in", "▁a", "an", "▁an", "▁and", "er", "on", "▁▁", "▁▁▁▁", "12",
]  # fmt: skip
# A small byte-level BPE: GPT-2's byte alphabet plus merges over it ("Ġ" is the space).
BL_MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "i n"]


def _byte_alphabet() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    symbols = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [symbols[b] for b in range(256)]


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``rows`` x ``cols`` values of random ``kind`` blocks, as raw bytes: random bits with
    small finite float16 scales (random bits there would be inf or NaN)."""
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    for at in _F16_AT[kind]:
        scales = (rng.standard_normal(raw.shape[:2]) * 2e-3).astype(np.float16)
        raw[:, :, at : at + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def sentencepiece_vocab(gemma: bool) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types); Gemma's order starts <pad> <eos> <bos> <unk>, and its
    runs of spaces are stored as spaces (llama.cpp does that to Gemma's vocabulary)."""
    if gemma:
        head = [(t, _CONTROL) for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")]
    else:
        head = [("<unk>", _UNKNOWN), ("<s>", _CONTROL), ("</s>", _CONTROL)]
    pieces = [" " * len(p) if gemma and set(p) == {"▁"} and len(p) > 1 else p for p in SP_PIECES]
    entries = [
        *head,
        *[(f"<0x{b:02X}>", _BYTE) for b in range(256)],
        *[(p, _USER if gemma and p.startswith(" ") else _NORMAL) for p in pieces],
        ("<start_of_turn>", _USER),
        ("<end_of_turn>", _USER),
    ]
    tokens = [t for t, _ in entries]
    scores = [0.0 if k != _NORMAL else -float(i) for i, (_, k) in enumerate(entries)]
    return tokens, scores, [k for _, k in entries]


def write_tiny_gguf(
    path: Path,
    arch: str,
    tokenizer: str = "llama",
    pre: str = "default",
    seed: int = 0,
    tied: bool = True,
    quantized: bool = False,
    embedding: GGMLQuantizationType | None = None,
    head_dim: int = HEAD_DIM,
    longrope: bool = False,
) -> Path:
    """A GGUF of ``arch`` (llama, qwen2, qwen3, gemma3, phi3, qwen3moe) with random weights
    and a ``tokenizer`` of kind ``llama`` (SentencePiece) or ``gpt2`` (byte-level, with ``pre``).

    Weights are F32, or with ``quantized`` the matrices (and the experts' stacked matrices)
    cycle through :data:`QUANT_TYPES`; ``embedding`` stores the embedding as random blocks of
    that type. HF's GGUF loader assumes Qwen3's head_dim is 128 and Gemma 3's query scale
    1/sqrt(256): use those there. Phi-3 is laid out as llama.cpp's converter writes it (fused
    ``attn_qkv``, gate and up fused in ``ffn_up``, a sliding window llama.cpp ignores), with
    ``longrope`` its LongRoPE factors as the ``rope_factors_long/short`` tensors.
    """
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, arch)
    gemma, phi3, moe = arch == "gemma3", arch == "phi3", arch == "qwen3moe"
    if tokenizer == "llama":
        tokens, scores, types = sentencepiece_vocab(gemma)
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        bos, eos, unk = (2, 1, 3) if gemma else (1, 2, 0)
        w.add_unk_token_id(unk)
        if gemma:
            w.add_pad_token_id(0)
        if phi3:  # Phi-3 pads with its end-of-text token
            w.add_pad_token_id(eos)
    else:
        merged = [m.replace(" ", "") for m in BL_MERGES]
        tokens = [*_byte_alphabet(), *merged, "<|endoftext|>", "<|im_end|>", "<think>"]
        types = [_NORMAL] * (len(tokens) - 3) + [_CONTROL, _CONTROL, _USER]
        w.add_tokenizer_model("gpt2")
        w.add_token_merges(BL_MERGES)
        bos, eos = len(tokens) - 3, len(tokens) - 2
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(tokenizer == "llama")
    w.add_add_eos_token(False)
    context = (LONGROPE_CONTEXT if longrope else PHI3_CONTEXT) if phi3 else 256
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    if arch in ("llama", "phi3"):
        w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if gemma:
        w.add_sliding_window(4)
    if phi3:
        # As llama.cpp's converter: always the original context, and the window (which
        # llama.cpp then ignores: "Phi SWA is currently disabled").
        w.add_rope_scaling_orig_ctx_len(LONGROPE_ORIGINAL if longrope else context)
        w.add_sliding_window(4)
        if longrope:
            scale = LONGROPE_CONTEXT / LONGROPE_ORIGINAL
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(LONGROPE_ORIGINAL))
            )
    if moe:
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(EXPERTS_USED)
        w.add_expert_feed_forward_length(EXPERT_FFN)

    kinds = iter(QUANT_TYPES * LAYERS * 10)

    def tensor(name: str, *shape: int, norm: bool = False) -> None:
        if quantized and len(shape) >= 2 and not name.startswith(("token_embd", "output")):
            kind = next(kinds)
            rows = int(np.prod(shape[:-1]))
            blocks = random_blocks(kind, rows, shape[-1], seed=seed)
            w.add_tensor(name, blocks.reshape(*shape[:-1], -1), raw_dtype=kind)
            return
        values = rng.standard_normal(shape).astype(np.float32) * (0.2 if norm else 0.1)
        w.add_tensor(name, values + (1.0 if norm else 0.0))

    if embedding is None:
        tensor("token_embd.weight", len(tokens), HIDDEN)
    else:
        w.add_tensor(
            "token_embd.weight", random_blocks(embedding, len(tokens), HIDDEN), raw_dtype=embedding
        )
    tensor("output_norm.weight", HIDDEN, norm=True)
    if not tied:
        tensor("output.weight", len(tokens), HIDDEN)
    if longrope:  # one factor per rotated pair, >= 1 (the long ones stretch further)
        pairs = np.arange(head_dim // 2, dtype=np.float32) / (head_dim // 2)
        w.add_tensor("rope_factors_long.weight", 1.0 + 8.0 * pairs**2)
        w.add_tensor("rope_factors_short.weight", 1.0 + 2.0 * pairs)
    for i in range(LAYERS):
        b = f"blk.{i}"
        if phi3:
            tensor(f"{b}.attn_qkv.weight", (HEADS + 2 * KV_HEADS) * head_dim, HIDDEN)
        else:
            tensor(f"{b}.attn_q.weight", HEADS * head_dim, HIDDEN)
            tensor(f"{b}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
            tensor(f"{b}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"{b}.attn_output.weight", HIDDEN, HEADS * head_dim)
        if moe:  # the router, then each expert's matrices stacked [experts, out, in]
            tensor(f"{b}.ffn_gate_inp.weight", EXPERTS, HIDDEN)
            tensor(f"{b}.ffn_gate_exps.weight", EXPERTS, EXPERT_FFN, HIDDEN)
            tensor(f"{b}.ffn_up_exps.weight", EXPERTS, EXPERT_FFN, HIDDEN)
            tensor(f"{b}.ffn_down_exps.weight", EXPERTS, HIDDEN, EXPERT_FFN)
        elif phi3:  # gate and up in one matrix, gate first
            tensor(f"{b}.ffn_up.weight", 2 * FFN, HIDDEN)
            tensor(f"{b}.ffn_down.weight", HIDDEN, FFN)
        else:
            tensor(f"{b}.ffn_gate.weight", FFN, HIDDEN)
            tensor(f"{b}.ffn_up.weight", FFN, HIDDEN)
            tensor(f"{b}.ffn_down.weight", HIDDEN, FFN)
        tensor(f"{b}.attn_norm.weight", HIDDEN, norm=True)
        tensor(f"{b}.ffn_norm.weight", HIDDEN, norm=True)
        if arch == "qwen2":
            tensor(f"{b}.attn_q.bias", HEADS * head_dim)
            tensor(f"{b}.attn_k.bias", KV_HEADS * head_dim)
            tensor(f"{b}.attn_v.bias", KV_HEADS * head_dim)
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            tensor(f"{b}.attn_q_norm.weight", head_dim, norm=True)
            tensor(f"{b}.attn_k_norm.weight", head_dim, norm=True)
        if gemma:
            tensor(f"{b}.post_attention_norm.weight", HIDDEN, norm=True)
            tensor(f"{b}.post_ffw_norm.weight", HIDDEN, norm=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_q5(blocks: np.ndarray, with_min: bool) -> np.ndarray:
    """ggml's dequantize_row_q5_0 / q5_1: a 5-bit value is a low nibble of ``qs`` plus one bit
    of ``qh``; Q5_0 centres it on 16, Q5_1 adds the block minimum instead."""
    blocks = blocks.reshape(-1, 24 if with_min else 22)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if with_min else 0.0
    at = 4 if with_min else 2
    qh = blocks[:, at : at + 4].copy().view(np.uint32)
    qs = blocks[:, at + 4 :].astype(np.uint32)
    j = np.arange(16, dtype=np.uint32)
    low = (qs & 0xF) | (((qh >> j) << 4) & 0x10)
    high = (qs >> 4) | ((qh >> (j + 12)) & 0x10)
    q = np.concatenate([low, high], axis=1).astype(np.float32)
    return (q * d + m if with_min else (q - 16) * d).reshape(-1)
