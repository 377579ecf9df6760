"""What the prefix cache stored and evicted since the last report: the router's view of a
replica (which prompt prefixes it holds) comes from these, carried by the heartbeat.

As vLLM's KV events (BlockStored / BlockRemoved), but pulled: the engine thread records,
the worker's heartbeat takes a report. Bounded: past ``limit`` changes between two reports
the changes are dropped and the next report is a reset with the pool's newest hashes. A
report the control plane never got (the heartbeat failed) is answered the same way, by
:meth:`PrefixEvents.lost`. Only a block's group-0 key (the 16-byte chained hash) is
reported; the other layer groups of a hybrid cache hold the same prefixes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hotpool.worker.prefix_hash import reported

HASH_BYTES = 16  # group 0's keys; other groups' are longer (kv_cache_manager._group_key)


@dataclass(frozen=True)
class PrefixReport:
    """Hashes (as :func:`reported`) stored and removed; ``reset``: forget all before."""

    stored: list[str]
    removed: list[str]
    reset: bool = False


class PrefixEvents:
    def __init__(self, cached: Callable[[], Iterable[bytes]], limit: int = 4096) -> None:
        self._cached = cached  # the pool's cached keys, oldest first, for a reset
        self.limit = limit
        self._lock = threading.Lock()  # the engine thread records, the event loop reports
        self._stored: dict[bytes, None] = {}  # ordered: the order they were cached
        self._removed: set[bytes] = set()
        self._reset = True  # the first report tells the whole state (empty on a fresh pool)

    def stored(self, block_hash: bytes) -> None:
        if len(block_hash) != HASH_BYTES:
            return
        with self._lock:
            self._removed.discard(block_hash)
            self._stored[block_hash] = None
            self._check_bound()

    def removed(self, block_hash: bytes) -> None:
        if len(block_hash) != HASH_BYTES:
            return
        with self._lock:
            if block_hash in self._stored:
                del self._stored[block_hash]  # stored and removed since the last report
                return
            self._removed.add(block_hash)
            self._check_bound()

    def lost(self) -> None:
        """The last report never arrived, or the cache was reset: the next report tells
        the whole state again."""
        with self._lock:
            self._stored.clear()
            self._removed.clear()
            self._reset = True

    def take(self) -> PrefixReport:
        with self._lock:
            if self._reset:
                keys = [h for h in self._cached() if len(h) == HASH_BYTES]
                newest = keys[-self.limit :] if self.limit > 0 else []
                report = PrefixReport([reported(h) for h in newest], [], reset=True)
            else:
                report = PrefixReport(
                    [reported(h) for h in self._stored], [reported(h) for h in self._removed]
                )
            self._stored.clear()
            self._removed.clear()
            self._reset = False
            return report

    def _check_bound(self) -> None:
        if len(self._stored) + len(self._removed) > self.limit:
            self._stored.clear()
            self._removed.clear()
            self._reset = True
