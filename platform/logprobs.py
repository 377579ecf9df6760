"""Token logprobs from the worker in the shapes clients read.

Chat (``choices[i].logprobs``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}]}``. Legacy completions: ``{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}``, where each top dict also holds the
sampled token (as OpenAI's does: up to ``logprobs + 1`` entries). One entry per completion
token, the end-of-sequence token included, so a choice's entries add up to what it bills.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from hotpool.worker.protocol import PositionLogprobs, TokenLogprob


def _entry(t: TokenLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.utf8)}


def chat_logprobs(positions: Sequence[PositionLogprobs]) -> dict[str, Any]:
    return {
        "content": [
            {**_entry(p.sampled), "top_logprobs": [_entry(t) for t in p.top]} for p in positions
        ]
    }


def native_logprobs(positions: Sequence[PositionLogprobs]) -> list[dict[str, Any]]:
    """The native invoke API's shape: the chat one, with token ids."""
    return [
        {
            "token_id": p.sampled.token_id,
            **_entry(p.sampled),
            "top_logprobs": [{"token_id": t.token_id, **_entry(t)} for t in p.top],
        }
        for p in positions
    ]


class CompletionLogprobs:
    """Legacy logprobs of one choice; ``text_offset`` runs on across streamed chunks.

    A token that holds part of a character (an emoji's first bytes) is shown as OpenAI shows
    it, ``bytes:\\xf0\\x9f``, and offsets count the characters of the text: such a token
    adds none, the one that completes the character adds it."""

    def __init__(self) -> None:
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def chunk(self, positions: Sequence[PositionLogprobs]) -> dict[str, Any]:
        tokens, offsets = [], []
        for p in positions:
            tokens.append(legacy_token(p.sampled))
            offsets.append(self.offset)
            self.offset += len(self._utf8.decode(bytes(p.sampled.utf8)))
        return {
            "tokens": tokens,
            "token_logprobs": [p.sampled.logprob for p in positions],
            "top_logprobs": [
                {
                    **{legacy_token(t): t.logprob for t in p.top},
                    legacy_token(p.sampled): p.sampled.logprob,
                }
                for p in positions
            ],
            "text_offset": offsets,
        }


def legacy_token(t: TokenLogprob) -> str:
    """The token's text, or ``bytes:\\xNN...`` when its bytes are not whole characters."""
    try:
        bytes(t.utf8).decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in t.utf8)
    return t.token
