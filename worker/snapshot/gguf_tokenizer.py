"""A GGUF's vocabulary as a ``tokenizers.Tokenizer`` and its ``tokenizer_config.json``.

Two kinds of vocabulary: ``gpt2`` (byte-level BPE with the file's merges) and ``llama``
(SentencePiece-style BPE with byte fallback, merges recovered from the vocabulary). Both match
what HF transformers builds from the same GGUF (``integrations/gguf/gguf_tokenizer_mapping.py``)
but for the one SmolLM2 difference noted in :func:`_smollm`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from hotpool.worker.snapshot.errors import SnapshotError

Meta = Mapping[str, Any]
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types: <|im_end|> / <bos>; <start_of_turn>
# How llama.cpp's named pre-tokenizers split text before byte-level BPE (HF's
# GGUF_PRE_TOKENIZER_SPLITS; Qwen2's is Qwen2Tokenizer's PRETOKENIZE_REGEX).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
}
_SPACE = "\u2581"  # SentencePiece's visible space


def _byte_alphabet() -> str:
    """GPT-2's 256 printable stand-ins for bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return "".join(map(chr, printable)) + "".join(chr(256 + i) for i in range(len(others)))


_BYTE_ALPHABET = _byte_alphabet()


def build_tokenizer(meta: Meta, sentencepiece: str) -> Tokenizer:
    """The tokenizer the GGUF describes; ``sentencepiece`` (``gemma``, ``llama`` or ``phi3``)
    says which HF tokenizer a SentencePiece vocabulary of this model family is."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level(meta)
    elif kind == "llama" and sentencepiece == "gemma":
        tok = _gemma(meta)
    elif kind == "llama" and sentencepiece == "phi3":
        tok = _phi3(meta)
    elif kind == "llama":
        tok = _llama(meta)
    else:
        raise SnapshotError(f"tokenizer model {kind!r} unsupported (gpt2, llama)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    template = _bos_eos_template(meta, tokens)
    if kind == "gpt2" and meta.get("tokenizer.ggml.pre") == "smollm":
        # As SmolLM2's own tokenizer.json: byte-level offsets, then BOS/EOS if any.
        byte_level = processors.ByteLevel(trim_offsets=False)
        adds = adds_bos(meta) or bool(meta.get("tokenizer.ggml.add_eos_token", False))
        tok.post_processor = processors.Sequence([byte_level, template]) if adds else byte_level
    else:
        tok.post_processor = template
    _add_marked_tokens(tok, meta, tokens)
    return tok


def _byte_level(meta: Meta) -> Tokenizer:
    """Byte-level BPE with the file's merges, text split as ``tokenizer.ggml.pre`` says."""
    pre = meta.get("tokenizer.ggml.pre")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.merges" not in meta:
        raise SnapshotError("a byte-level (gpt2) vocabulary needs tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = _merges(meta, tokens, {})
    if pre == "smollm":
        return _smollm(vocab, merges)
    if pre not in _SPLITS:
        known = ", ".join(("smollm", *_SPLITS))
        raise SnapshotError(f"pre-tokenizer {pre!r} unsupported (known: {known})")
    # HF's GPT2Tokenizer, with the split regex llama.cpp names by ``pre``.
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _smollm(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """Byte-level BPE equal to SmolLM2's own ``tokenizer.json``.

    llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) isolates every digit
    before GPT-2's byte-level regex; HF's GGUF loader skips that step, so on a run of spaces
    before a digit we follow the model, not HF.
    """
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _gemma(meta: Meta) -> Tokenizer:
    """HF's ``GemmaTokenizer``: spaces become ``▁`` before BPE, never a prefix space.

    llama.cpp stores Gemma's tokens of two or more spaces as real spaces, where the
    vocabulary looks them up as ``▁▁``: respell them first. The file has no merges, and
    Gemma's scores do not follow its merge order; the tokens' order in the file does.
    """
    tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in _tokens(meta)]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=_merges(meta, tokens, {t: -i for i, t in enumerate(tokens)}),
            unk_token=_token(meta, tokens, "unknown_token_id") or "<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


def _llama(meta: Meta) -> Tokenizer:
    """HF's ``LlamaTokenizer``: a ``▁`` before the first word (unless the file says not),
    merges ranked by the tokens' scores."""
    tokens = _tokens(meta)
    scores = dict(zip(tokens, meta["tokenizer.ggml.scores"], strict=True))
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=_merges(meta, tokens, scores),
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _phi3(meta: Meta) -> Tokenizer:
    """Phi-3's own ``tokenizer.json`` (and HF's GGUF loader for phi3): Llama's, but the ``▁``
    is prepended by a normalizer, even to text that starts with a space (``"  hi"`` is
    ``▁▁▁hi``, as llama.cpp's SentencePiece tokenizer has it), with no pre-tokenizer."""
    tok = _llama(meta)
    if bool(meta.get("tokenizer.ggml.add_space_prefix", True)):
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)]
        )
    else:
        tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.pre_tokenizer = None
    return tok


def _tokens(meta: Meta) -> list[str]:
    return list(meta["tokenizer.ggml.tokens"])


def _merges(
    meta: Meta, tokens: Sequence[str], scores: Mapping[str, float]
) -> list[tuple[str, str]]:
    """The file's merges, or the ones its vocabulary implies: every split of a token into two
    tokens, best-scored token first (HF's ``generate_merges``, so ties break the same way)."""
    if "tokenizer.ggml.merges" in meta:
        return [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]  # type: ignore[misc]
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        pairs = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        found.extend(sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    found.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _bos_eos_template(meta: Meta, tokens: list[str]) -> processors.PostProcessor:
    """BOS/EOS where the GGUF asks for them on every encode (HF's template, empty when it
    asks for neither)."""
    add_bos, add_eos = adds_bos(meta), bool(meta.get("tokenizer.ggml.add_eos_token", False))
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
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _add_marked_tokens(tok: Tokenizer, meta: Meta, tokens: list[str]) -> None:
    """Control tokens (``<bos>``, ``<|im_end|>``) become special added tokens, user-defined
    ones (``<start_of_turn>``, ``<think>``) plain added tokens: llama.cpp matches both whole
    in text, so BPE must never cut them apart."""
    kinds = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = tok.get_vocab()
    control = [t for t, kind in zip(tokens, kinds, strict=True) if kind == _CONTROL]
    if meta.get("tokenizer.ggml.model") == "gpt2":
        # Every real token of a byte-level vocabulary is spelled in the byte alphabet: a
        # "control" one that is not is a llama.cpp mislabel, and HF leaves it out too.
        alphabet = set(_BYTE_ALPHABET)
        control = [t for t in control if set(t) <= alphabet]
    unknown = _token(meta, tokens, "unknown_token_id")
    if unknown is not None and unknown not in control:  # HF makes its unk token special too
        control.insert(0, unknown)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, kind in zip(tokens, kinds, strict=True) if kind == _USER_DEFINED]
    # A Gemma run of spaces was respelled with ▁ above; as spaces it is no token to add.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user if t in vocab])


def adds_bos(meta: Meta) -> bool:
    """Whether every encode starts with BOS. Older SentencePiece files have no flag, and
    llama.cpp adds BOS to those."""
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _token(meta: Meta, tokens: Sequence[str], key: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{key}")
    return tokens[int(index)] if index is not None else None


def tokenizer_config(meta: Meta, chat_template: str | None = None) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens, BOS/EOS flags and the chat template
    (``chat_template`` replaces the GGUF's own, for files that lack one)."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    arch = meta["general.architecture"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(meta, tokens, "bos_token_id"),
        "eos_token": _token(meta, tokens, "eos_token_id"),
        "pad_token": _token(meta, tokens, "padding_token_id"),
        "unk_token": _token(meta, tokens, "unknown_token_id"),
        "add_bos_token": adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta[f"{arch}.context_length"]),
    }
    template = chat_template or meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config
