"""Tool calls read out of a choice's streamed text, as OpenAI's ``delta.tool_calls``.

A :class:`ToolCallParser` takes the text the detokenizer releases, piece by piece, and gives
back the content to stream and the pieces of each tool call it completes. A call goes out
once whole (its JSON must parse): a first piece with its ``id``, ``type`` and ``name`` and
empty ``arguments``, then one with the arguments as compact JSON (the control plane streams
each piece in a chunk of its own, in OpenAI's order: ``hotpool.platform.openai_routes``).
Text that may still turn out to open a call is held back; whitespace around calls is
dropped (it separates calls); a block that does not hold a call (bad JSON, no name) stays
content, as it was written.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from hotpool.worker.structured.tools import HERMES_END, HERMES_START, ToolFormat, compact

_ALPHANUMERIC = string.ascii_letters + string.digits
_PYTHON_TAG = "<|python_tag|>"  # Llama 3's, when the tokenizer does not drop it


def call_id() -> str:
    """An id for a call, shaped like OpenAI's (``call_`` and 24 letters and digits)."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


Piece = dict[str, Any]


class ToolCallParser:
    """One choice's text in, (content, tool call pieces) out; :attr:`calls` counts the calls."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls = 0
        self._buf = ""  # text not yet given out: a possible call's start, or a call's body
        self._in_call = False  # Hermes: inside <tool_call>
        self._space = ""  # trailing whitespace held back: it goes if a call follows
        self._before = ""  # what was held before the open call, back if it is none
        self._after_call = False  # whitespace right after a call is dropped
        self._emitted = False  # some content is out
        self._mode: str | None = None  # Llama 3: None until the first non-space character

    def push(self, text: str) -> tuple[str, list[Piece]]:
        """Newly released text in; the content to send and the pieces of finished calls."""
        if not text:
            return "", []
        self._buf += text
        if self.fmt == "llama3_json":
            return self._llama3(final=False)
        return self._hermes(final=False)

    def flush(self) -> tuple[str, list[Piece]]:
        """The end of the choice: whatever is held back, an unclosed call parsed if whole."""
        content, pieces = self._llama3(True) if self.fmt == "llama3_json" else self._hermes(True)
        if not self._after_call:
            content += self._space
        self._space = ""
        return content, pieces

    # --- Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> ----------------

    def _hermes(self, final: bool) -> tuple[str, list[Piece]]:
        content: list[str] = []
        pieces: list[Piece] = []
        while True:
            if not self._in_call:
                at = self._buf.find(HERMES_START)
                if at == -1:
                    keep = 0 if final else _prefix_at_end(self._buf, HERMES_START)
                    content.append(self._text(self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._text(self._buf[:at]))
                self._before, self._space = self._space, ""  # whitespace before a call goes
                self._buf = self._buf[at + len(HERMES_START) :]
                self._in_call = True
            end = self._buf.find(HERMES_END)
            if end == -1 and not final:
                break
            body = self._buf if end == -1 else self._buf[:end]
            self._buf = "" if end == -1 else self._buf[end + len(HERMES_END) :]
            self._in_call = False
            call = _call(body, "arguments")
            if call is None:  # not a call: the block as written
                closing = "" if end == -1 else HERMES_END
                self._space = self._before
                content.append(self._text(HERMES_START + body + closing))
            else:
                pieces += self._pieces(*call)
            if end == -1:
                break
        return "".join(content), pieces

    # --- Llama 3: {"name": ..., "parameters": {...}}; {...} ----------------------------------

    def _llama3(self, final: bool) -> tuple[str, list[Piece]]:
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(_PYTHON_TAG):
                head = head[len(_PYTHON_TAG) :].lstrip()
            if not final and _PYTHON_TAG.startswith(head):  # nothing yet, or the tag's start
                return "", []
            self._mode = "calls" if head.startswith("{") else "content"
            if self._mode == "calls":
                self._buf = head
        pieces: list[Piece] = []
        decoder = json.JSONDecoder()
        while self._mode == "calls":
            if self.calls:
                self._buf = self._buf.lstrip("; \t\r\n")  # the separators between calls
            if not self._buf:
                break
            if not self._buf.startswith("{"):
                self._mode = "content"  # text after the calls
                break
            try:
                value, end = decoder.raw_decode(self._buf)
            except ValueError:
                break  # not whole yet (or never: then it is content at the end)
            call = _call_value(value, "parameters")
            if call is None:
                self._mode = "content"  # JSON, but no call: an answer
                break
            pieces += self._pieces(*call)
            self._buf = self._buf[end:]
        if self._mode == "content" or final:
            text, self._buf = self._buf, ""
            return text, pieces
        return "", pieces

    # --- shared ----------------------------------------------------------------------------

    def _text(self, text: str) -> str:
        """Content with the whitespace rules: trailing space held until something that is
        not a call follows, and none after a call until the first content."""
        text = self._space + text
        self._space = ""
        if self._after_call:
            if not self._emitted:
                text = text.lstrip()
            if not text.strip():
                self._space = text  # kept if content follows, not if a call does
                return ""
            self._after_call = False
        core = text.rstrip()
        self._space = text[len(core) :]
        self._emitted = self._emitted or bool(core)
        return core

    def _pieces(self, name: str, arguments: Any) -> list[Piece]:
        index = self.calls
        self.calls += 1
        self._after_call = True
        self._space = ""
        function = {"name": name, "arguments": ""}
        return [
            {"index": index, "id": call_id(), "type": "function", "function": function},
            {"index": index, "function": {"arguments": compact(arguments)}},
        ]


def _call(body: str, key: str) -> tuple[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _call_value(value, key)


def _call_value(value: Any, key: str) -> tuple[str, Any] | None:
    """(name, arguments) of a call object; the arguments under ``key``, or under the other
    format's key (models mix them up), or as a JSON object's text."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    other = "parameters" if key == "arguments" else "arguments"
    arguments = value.get(key, value.get(other, {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], arguments


def _prefix_at_end(text: str, token: str) -> int:
    """The length of the longest end of ``text`` that ``token`` starts with."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
