"""Which prompt prefixes a replica's KV cache holds, as its worker reports them: the chained
block hashes of worker/prefix_hash.py (first 8 bytes, hex), newest last, bounded.

Heartbeats bring what the worker cached and evicted since the last one (or a reset with its
newest hashes); the router also adds a prompt's hashes the moment it sends the prompt there,
since the worker caches them as it prefills, long before the next heartbeat. Hashes never
leave the control plane's memory: no API shows them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

MAX_HASHES = 65536  # ~1M tokens of prefixes at 16 tokens a block; the oldest go first


class PrefixSet:
    def __init__(self, limit: int = MAX_HASHES) -> None:
        self.limit = limit
        self.block_size: int | None = None  # the worker's KV block size, once reported
        self._hashes: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def report(
        self,
        stored: Iterable[str],
        removed: Iterable[str],
        reset: bool,
        block_size: int | None,
    ) -> None:
        """Apply a heartbeat's changes (``reset``: forget everything before them)."""
        if block_size is not None:
            self.block_size = block_size
        if reset:
            self._hashes.clear()
        for h in removed:
            self._hashes.pop(h, None)
        self.add(stored)

    def add(self, hashes: Iterable[str]) -> None:
        """The replica holds (or is about to hold) these; each becomes the newest."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.limit:
            self._hashes.popitem(last=False)

    def matched(self, hashes: Sequence[str]) -> int:
        """How many leading blocks of a prompt (its chained ``hashes``) are held: a block
        counts only if every block before it does, as in the worker's own lookup."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def clear(self) -> None:
        self._hashes.clear()
