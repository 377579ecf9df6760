"""Text <-> token ids for a snapshot: ``tokenizer.json``, its config and chat template."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from hotpool.worker.protocol import ChatMessage


class TemplateError(ValueError):
    """The chat template could not render these messages."""


class TextTokenizer:
    def __init__(self, snapshot_dir: Path) -> None:
        self._tok = Tokenizer.from_file(str(snapshot_dir / "tokenizer.json"))
        cfg_path = snapshot_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token: str | None = _token_str(cfg.get("bos_token"))
        self.eos_token: str | None = _token_str(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        # Templates are user-supplied code: render them in Jinja's sandbox.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template) if template else None
        decoder = self._tok.decoder
        decoder_json = decoder.__getstate__().decode() if decoder is not None else ""
        self._byte_level = '"ByteLevel"' in decoder_json
        self._byte_fallback = '"ByteFallback"' in decoder_json
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._pieces: dict[int, tuple[str, tuple[int, ...]]] = {}

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = {self._tok.token_to_id(t) for t in (self.eos_token,) if t}
        return frozenset(i for i in ids if i is not None)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_piece(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """One token's text and exact UTF-8 bytes, as logprobs show them.

        Decoding a lone token loses what logprobs need: a SentencePiece token's leading space
        and the bytes of a partial character. So the bytes come from the vocabulary entry
        (byte-level symbols mapped back to bytes, ``<0xNN>`` fallback pieces, ``▁`` as a
        space); the text is those bytes decoded, U+FFFD where they end mid-character. Special
        tokens show as their names, as vLLM shows them.
        """
        cached = self._pieces.get(token_id)
        if cached is None:
            raw = self._token_bytes(token_id)
            text = self._added.get(token_id) or raw.decode("utf-8", errors="replace")
            cached = self._pieces[token_id] = (text, tuple(raw))
        return cached

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level and all(c in _BYTE_OF_SYMBOL for c in piece):
            return bytes(_BYTE_OF_SYMBOL[c] for c in piece)
        if self._byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str:
        if self._template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except Exception as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc


def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable symbol that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    symbols = {chr(b): b for b in printable}
    symbols.update({chr(256 + i): b for i, b in enumerate(others)})
    return symbols


_BYTE_OF_SYMBOL = _byte_symbols()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_str(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} form
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)
