"""Text <-> token ids for a snapshot: ``tokenizer.json``, its config and chat template."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from hotpool.worker.protocol import ChatMessage
from hotpool.worker.structured.tools import (
    ToolFormat,
    template_knows_tools,
    template_messages,
    tool_format,
)

# What :class:`TextTokenizer` reads of a snapshot: the control plane's router fetches these
# from a worker (``GET /tokenizer``) to hash prompts as the worker will.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class TemplateError(ValueError):
    """The chat template could not render these messages."""


class TextTokenizer:
    def __init__(self, snapshot_dir: Path) -> None:
        self.snapshot_dir = snapshot_dir
        self._tok = Tokenizer.from_file(str(snapshot_dir / "tokenizer.json"))
        cfg_path = snapshot_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token: str | None = _token_str(cfg.get("bos_token"))
        self.eos_token: str | None = _token_str(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self._generation_eos = _generation_eos_ids(snapshot_dir / "generation_config.json")
        template = cfg.get("chat_template")
        # Templates are user-supplied code: render them in Jinja's sandbox.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self._template = env.from_string(template) if template else None
        source = template if isinstance(template, str) else None
        # Whether the template renders `tools` itself, and the call format it teaches.
        self.knows_tools = template_knows_tools(source)
        self.tool_format: ToolFormat = tool_format(source)
        decoder = self._tok.decoder
        decoder_json = decoder.__getstate__().decode() if decoder is not None else ""
        self._byte_level = '"ByteLevel"' in decoder_json
        self._byte_fallback = '"ByteFallback"' in decoder_json
        added = self._tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self._pieces: dict[int, tuple[str, tuple[int, ...]]] = {}
        # Control tokens' texts, longest first (so "<|im_end|>" is not read as a shorter one
        # it starts with): the special ones, and added ones that look like markup (Qwen's
        # <tool_call> and <think> are not flagged special), with a copy of the tokenizer that
        # reads all of them as plain text.
        controls = sorted(
            {t.content for t in added.values() if t.special or _MARKUP.fullmatch(t.content)},
            key=len,
            reverse=True,
        )
        self._special_ids = {t: self._tok.token_to_id(t) for t in controls}
        self._specials = re.compile("|".join(map(re.escape, controls))) if controls else None
        literal = json.loads(self._tok.to_str())
        for entry in literal.get("added_tokens") or ():
            if entry.get("content") in self._special_ids:
                entry["special"] = True  # so that encode_special_tokens reads it as text
        self._literal = Tokenizer.from_str(json.dumps(literal))
        self._literal.encode_special_tokens = True

    def to_json(self) -> str:
        """The tokenizer as HF ``tokenizers`` serializes it (what grammar engines read)."""
        return self._tok.to_str()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS and generation_config.json's ``eos_token_id`` (a chat model's
        end of turn may be only there: Gemma's ``<end_of_turn>``)."""
        ids = {self._tok.token_to_id(t) for t in (self.eos_token,) if t}
        return frozenset(i for i in ids if i is not None) | self._generation_eos

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return self._with_bos(_ids(self._tok, text))

    def _with_bos(self, ids: list[int]) -> list[int]:
        bos = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def encode_chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """A chat's prompt: the template rendered and tokenized, where control tokens come
        from the template only.

        What a message says is text, as OpenAI treats it: a message that spells a control
        token (``<|im_end|>``), or that the template turns into one (``|lower`` of
        ``<|IM_END|>``), gets that text's plain tokens; read as the token, it would end the
        user's turn and let the user write the assistant's or the system's (role spoofing).
        To tell the messages' text from the template's, the template is rendered once with
        each message's text (and name) between two lone surrogates, which no text holds (the
        control plane refuses them). The strings of ``tools`` and of tool calls that spell
        control text are marked the same way. A chat whose messages hold no control text gets
        exactly ``encode(apply_chat_template(messages, tools))``."""
        found = self._specials
        if found is None:
            return self.encode(self.apply_chat_template(messages, tools))
        chat, tool_list = self._chat(messages, tools)
        enclosed = [_enclosed(m, found) for m in chat]
        marked = None if tool_list is None else _marked(tool_list, found)
        parts = _regions(self._render(enclosed, marked))
        if parts is None:  # the template cut a message's text apart: as rendered, then
            return self.encode(self._render(chat, tool_list))
        if not any(is_text and found.search(t) for t, is_text in parts):
            return self.encode(self._render(chat, tool_list))
        ids: list[int] = []
        plain: list[str] = []  # text to tokenize as one piece, up to the next control token
        for text, is_text in parts:
            if is_text:
                plain.append(text)
                continue
            at = 0
            for control in found.finditer(text):  # the template's own control tokens
                plain.append(text[at : control.start()])
                ids += self._plain("".join(plain))
                plain.clear()
                ids.append(self._special_ids[control.group()])
                at = control.end()
            plain.append(text[at:])
        ids += self._plain("".join(plain))
        return self._with_bos(ids)

    def _plain(self, text: str) -> list[int]:
        """``text`` tokenized as plain text (control tokens' texts included)."""
        if not text:
            return []
        return _ids(self._literal, text)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """At least as many bytes of text as any one token stands for (the UTF-8 of its
        vocabulary string: a byte-level symbol or a piece's "▁" is longer than the byte
        it stands for, never shorter), so that a text of N bytes has at least
        ``N // max_token_bytes`` tokens without being tokenized."""
        return max(
            (len(t.encode()) for t in self._tok.get_vocab(with_added_tokens=False)), default=1
        )

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

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text; ``tools`` (OpenAI's function tools) as the template renders them,
        or in the system message when it does not know tools
        (:func:`~hotpool.worker.structured.tools.template_messages`)."""
        return self._render(*self._chat(messages, tools))

    def _chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The template's ``messages`` and ``tools`` (None unless it renders them itself)."""
        chat = template_messages(messages, tools, self.knows_tools)
        return chat, list(tools) if tools and self.knows_tools else None

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        if self._template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except Exception as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc


_OPEN, _CLOSE = "\ud800", "\udc00"  # around a message's text while the template renders
_MARKS = re.compile(f"[{_OPEN}{_CLOSE}]")
_MARKUP = re.compile(r"<[^\s<>]{1,64}>")  # an added token like <tool_call> or <|fim_pad|>


# Longer texts are tokenized through ``encode_batch``, which lets go of the GIL while it works
# (``encode`` holds it throughout: a megabyte of prompt, ~0.5 s, stopped every other thread
# of the process; the worker's engine steps and the control plane's event loop with them).
RELEASE_GIL_CHARS = 16 << 10


def _ids(tok: Tokenizer, text: str) -> list[int]:
    if len(text) > RELEASE_GIL_CHARS:
        return list(tok.encode_batch([text], add_special_tokens=False)[0].ids)
    return list(tok.encode(text, add_special_tokens=False).ids)


def _enclosed(message: dict[str, Any], found: re.Pattern[str]) -> dict[str, Any]:
    """A template message with its text and name enclosed, and any other string of it (tool
    calls, their ids) that spells control text."""
    out = _marked(message, found)
    for key in ("content", "name"):
        if isinstance(message.get(key), str):
            out[key] = _enclose(message[key])
    return out  # type: ignore[no-any-return]


def _marked(value: Any, found: re.Pattern[str]) -> Any:
    """``value`` (JSON data) with each string that spells control text enclosed, keys too."""
    if isinstance(value, str):
        return _enclose(value) if found.search(value) else value
    if isinstance(value, list):
        return [_marked(v, found) for v in value]
    if isinstance(value, dict):
        return {_marked(k, found): _marked(v, found) for k, v in value.items()}
    return value


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's ``tojson`` for chat templates: plain JSON (Jinja's own escapes ``<``, ``>``, ``&``
    and ``'`` for HTML, which no tool-calling template expects)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _enclose(text: str) -> str:
    """``text`` between the marks, its leading and trailing whitespace outside them, so that
    a template's ``|trim`` still trims it."""
    core = text.strip()
    if not core:
        return text
    head = text[: len(text) - len(text.lstrip())]
    return f"{head}{_OPEN}{core}{_CLOSE}{text[len(head) + len(core) :]}"


def _regions(marked: str) -> list[tuple[str, bool]] | None:
    """``marked`` split into (piece, is a message's text), the marks removed; None when the
    marks do not pair up (the template sliced a message's text)."""
    parts: list[tuple[str, bool]] = []
    inside, at = False, 0
    for mark in _MARKS.finditer(marked):
        if (mark.group() == _OPEN) == inside:  # an open inside a text, or a close outside one
            return None
        parts.append((marked[at : mark.start()], inside))
        inside, at = not inside, mark.end()
    if inside:
        return None
    parts.append((marked[at:], False))
    return parts


def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable symbol that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    symbols = {chr(b): b for b in printable}
    symbols.update({chr(256 + i): b for i, b in enumerate(others)})
    return symbols


_BYTE_OF_SYMBOL = _byte_symbols()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _generation_eos_ids(path: Path) -> frozenset[int]:
    """``eos_token_id`` of a generation_config.json (an id or a list of ids), if any."""
    if not path.exists():
        return frozenset()
    eos = json.loads(path.read_text()).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def _token_str(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} form
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)
