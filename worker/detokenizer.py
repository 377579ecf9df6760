"""Incremental detokenization with stop strings.

Byte-level BPE can split one character over several tokens, and a stop string can span
tokens, so text is released only when it is final: never a half character (U+FFFD at the
end) and never a prefix that might still become a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from hotpool.worker.tokenizer import TextTokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._text = ""  # decoded so far (stable part)
        self._sent = 0  # characters of _text already released
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return newly final text. Sets :attr:`stopped` when a stop string hits."""
        self._ids.extend(token_ids)
        # An incomplete UTF-8 sequence decodes to U+FFFD at the end: hold it back until its
        # last byte arrives, but look for stop strings in the text before it right away.
        text = self._tok.decode(self._ids).rstrip("\ufffd")
        self._text = text
        # Only the unsent tail (plus overlap) can hold a new match; the earliest match wins,
        # whatever the order of the stop strings.
        hits = [at for s in self._stop if (at := text.find(s, max(0, self._sent - len(s)))) != -1]
        if hits:
            self.stopped = True
            self._text = text[: min(hits)]
            return self._release(len(self._text))
        return self._release(max(self._sent, len(text) - self._hold))

    def flush(self) -> str:
        """The held-back tail, once generation has finished."""
        return self._release(len(self._text))

    def _release(self, upto: int) -> str:
        upto = min(upto, len(self._text))
        out = self._text[self._sent : upto]
        self._sent = max(self._sent, upto)
        return out
