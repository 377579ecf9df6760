"""Incremental detokenization with stop strings.

Byte-level BPE can split one character over several tokens, and a stop string can span
tokens, so text is released only when it is final: never a half character (U+FFFD at the
end) and never a prefix that might still become a stop string.

Each step decodes only a short window of recent tokens, as vLLM's
``detokenize_incrementally`` does, so streaming costs time linear in the output's length.
"""

from __future__ import annotations

from collections.abc import Sequence

from hotpool.worker.tokenizer import TextTokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas for one request.

    Contract: the concatenation of everything :meth:`push` and :meth:`flush` return equals
    ``tokenizer.decode(all ids)`` cut before the earliest stop string (less a trailing
    incomplete character, if generation ended inside one); no delta holds a broken
    character or any part of a stop string that matched.
    """

    def __init__(
        self, tokenizer: TextTokenizer, stop: Sequence[str] = (), min_tokens: int = 0
    ) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        # As vLLM's stop checker: no stop string ends the text before the min_tokens-th token.
        # A match counts once it ends past the text of the first min_tokens - 1 tokens (known
        # when the min_tokens-th arrives; a match may start before it).
        self._min_tokens = min_tokens
        self._floor: int | None = None if min_tokens > 1 and self._stop else 0
        self._released = 0  # characters released so far
        # A stop string may begin in the last len-1 characters: hold those until it can't.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        # ids[:read] are accounted for. ids[prefix:read] are decoded again as context for
        # what follows, because decoders treat a sequence's first token specially (the
        # SentencePiece leading space), so the new text is the difference of two decodes.
        self._prefix = 0
        self._read = 0
        self._partial = ""  # text of ids[read:] that precedes a still incomplete character
        self._pending = ""  # final text not yet released
        self._sent_tail = ""  # the last `hold` characters released
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return newly final text. Sets :attr:`stopped` when a stop string hits."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        context = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        # An incomplete UTF-8 sequence decodes to U+FFFD at the end: hold it back until its
        # last byte arrives, but let stop strings see the text before it right away.
        complete = not text.endswith(_REPLACEMENT)
        text = text.rstrip(_REPLACEMENT)
        new = text[len(context) + len(self._partial) :]
        if complete:
            self._prefix, self._read, self._partial = self._read, len(self._ids), ""
        else:
            self._partial += new
        self._pending += new
        if self._floor is None and len(self._ids) >= self._min_tokens:
            before = self._tok.decode(self._ids[: self._min_tokens - 1])
            self._floor = len(before.rstrip(_REPLACEMENT))
        return self._release_final()

    @property
    def released_chars(self) -> int:
        """Characters of text released so far."""
        return self._released

    @property
    def decoded_chars(self) -> int:
        """Characters of final text so far, released or held back for the stop strings."""
        return self._released + len(self._pending)

    def flush(self) -> str:
        """The held-back tail, once generation has finished."""
        return self._take(len(self._pending))

    def _release_final(self) -> str:
        # A match cannot start earlier than the held tail (it would have been seen on an
        # earlier push), so only the tail and the pending text are searched; the earliest
        # match wins, whatever the order of the stop strings.
        if self._floor is None:  # fewer than min_tokens tokens: nothing can stop yet
            return self._take(len(self._pending) - self._hold)
        window = self._sent_tail + self._pending
        floor = self._floor - (self._released - len(self._sent_tail))  # in the window
        hits = [
            at
            for s in self._stop
            if (at := window.find(s, max(0, floor - len(s) + 1))) != -1  # ends past the floor
        ]
        if hits:
            self.stopped = True
            out = self._pending[: max(0, min(hits) - len(self._sent_tail))]
            self._pending = ""
            self._released += len(out)
            return out
        return self._take(len(self._pending) - self._hold)

    def _take(self, n: int) -> str:
        out, self._pending = self._pending[: max(0, n)], self._pending[max(0, n) :]
        self._released += len(out)
        if self._hold:
            self._sent_tail = (self._sent_tail + out)[-self._hold :]
        return out
