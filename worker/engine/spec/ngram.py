"""Prompt lookup decoding (llama.cpp's ``lookup``, vLLM's n-gram proposer): guess that the
sequence repeats itself.

Take the last ``n`` tokens of prompt + output, for ``n`` from ``max_n`` down to ``min_n``;
at the first ``n`` whose n-gram occurred before, propose the tokens that followed its most
recent earlier occurrence. Code edits, summaries, retrieval answers and structured output
copy long spans of their prompt, and guesses from those spans are often right; it needs no
model and no GPU.

Each request keeps an index from every n-gram of its tokens to the position after its
latest occurrence, updated as tokens arrive: a step costs ``O(max_n + k)`` however long
the sequence, where a rescan costs ``O(length)`` (on 32k tokens: ~1 us against ~10 ms;
``tests/worker/test_spec_ngram.py`` holds it to that). The index holds one entry per
distinct n-gram: about ``(max_n - min_n + 1) * length`` entries at worst, some 100 bytes
each, released with the request.
"""

from __future__ import annotations

from collections.abc import Sequence

from hotpool.worker.engine.spec.proposer import ProposalInput, Proposer
from hotpool.worker.protocol import NgramConfig

# An n-gram's key packs its tokens 32 bits each under a marker bit at 32 * n, so keys of
# different lengths never collide and one dict serves every n. Exact: no hashing of ours.
_TOKEN_BITS = 32
_TOKEN_LIMIT = 1 << _TOKEN_BITS
# Up to this many new tokens (a decode step's) are indexed one by one; more (a prompt) a list
# at a time, which costs more to set up and less per token.
_FEW = 8


class _Index:
    """One request's tokens and, for each of its n-grams that something followed, the
    position of the token after its latest occurrence."""

    def __init__(self, config: NgramConfig) -> None:
        self.min_n = config.min_n
        self.max_n = config.max_n
        self.tokens: list[int] = []
        self.after: dict[int, int] = {}

    def extend(self, new: Sequence[int]) -> None:
        if new and not (min(new) >= 0 and max(new) < _TOKEN_LIMIT):
            raise ValueError(f"token ids must be in [0, 2**32), got {min(new)}..{max(new)}")
        toks = self.tokens
        if len(new) <= _FEW:
            for t in new:
                toks.append(t)
                if len(toks) > 1:  # the n-grams ending before t are followed now, by t
                    self._insert(len(toks) - 2)
        else:
            lo = max(len(toks) - 1, 0)
            toks.extend(new)
            self._insert_all(lo, len(toks) - 1)

    def _insert(self, end: int) -> None:
        """Index the n-grams ending at ``end``, followed by ``end + 1``."""
        toks, after, min_n = self.tokens, self.after, self.min_n
        key = 0
        for n in range(1, min(self.max_n, end + 1) + 1):
            key |= toks[end - n + 1] << (_TOKEN_BITS * (n - 1))
            if n >= min_n:
                after[key | (1 << (_TOKEN_BITS * n))] = end + 1

    def _insert_all(self, lo: int, hi: int) -> None:
        """Index the n-grams ending at ``[lo, hi)``, a list at a time: twice as fast as
        ``_insert`` one end at a time on a long prompt. In position order, so a later
        occurrence overwrites an earlier one."""
        toks, after = self.tokens, self.after
        keys: list[int] = []
        start = lo  # where the n-grams of `keys` end first
        for n in range(1, self.max_n + 1):
            first = max(lo, n - 1)  # no n-gram ends before n - 1
            if first >= hi:
                break
            if n == 1:
                keys = toks[lo:hi]
            else:
                shift = _TOKEN_BITS * (n - 1)
                keys = [
                    key | (t << shift)
                    for key, t in zip(
                        keys[first - start :], toks[first - n + 1 : hi - n + 1], strict=True
                    )
                ]
            start = first
            if n >= self.min_n:
                tag = 1 << (_TOKEN_BITS * n)
                after.update(
                    zip([key | tag for key in keys], range(first + 1, hi + 1), strict=True)
                )

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        end = len(toks) - 1
        # The suffix itself is not indexed yet (nothing follows it), so a hit is an earlier
        # occurrence; an n-gram can occur earlier only if n < len(toks).
        top = min(self.max_n, end)
        keys = []
        key = 0
        for n in range(1, top + 1):
            key |= toks[end - n + 1] << (_TOKEN_BITS * (n - 1))
            keys.append(key | (1 << (_TOKEN_BITS * n)))
        for n in range(top, self.min_n - 1, -1):
            pos = self.after.get(keys[n - 1])
            if pos is not None:
                return toks[pos : pos + k]
        return []


class NgramProposer(Proposer):
    """Prompt lookup over each request's own tokens (see the module's docstring)."""

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self._indexes: dict[str, _Index] = {}

    def propose(self, requests: Sequence[ProposalInput], k: int) -> list[list[int]]:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return [self._index(r).propose(k) if k else [] for r in requests]

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        """How many requests hold an index (each until it is released)."""
        return len(self._indexes)

    def _index(self, request: ProposalInput) -> _Index:
        """The request's index, caught up with its tokens."""
        index = self._indexes.get(request.request_id)
        seen = 0 if index is None else len(index.tokens)
        # The contract says tokens only grow; a sequence that did not (a reused id, a
        # rewrite) is indexed afresh rather than trusted. The check is O(1): the length and
        # the last token seen.
        if (
            index is None
            or request.num_tokens < seen
            or (seen and request.token(seen - 1) != index.tokens[-1])
        ):
            index = self._indexes[request.request_id] = _Index(self.config)
            seen = 0
        if request.num_tokens > seen:
            index.extend(request.tokens_from(seen))
        return index
