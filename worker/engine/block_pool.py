"""The block pool: every KV cache block, its reference count, the free queue and the prefix cache.

Pure Python (no torch) so it can be tested exhaustively. A block is *free* when no request
references it (``ref_cnt == 0``); a free block may still hold the hash of the full block of
tokens whose KV it contains, which makes it a prefix-cache hit until it is evicted. Free blocks
wait in a queue in least-recently-freed order: allocation pops from the head, and a popped
block loses its hash (eviction). A prefix hit on a free block takes it back out of the queue.

For sliding-window attention the pool can pin one block as a *placeholder* (vLLM's
``null_block``): block-table entries that no query will read again point at it, so tables keep
their length and slot arithmetic. It is never allocated, freed, touched or cached, and it does
not count among the usable blocks.

Inspired by vLLM v1's ``BlockPool`` / ``FreeKVCacheBlockQueue`` and nano-vllm's
``BlockManager``; the free queue here is an ``OrderedDict`` keyed by block id, which gives the
same O(1) append / remove / pop-oldest as vLLM's hand-written linked list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from hotpool.worker.engine.prefix_events import PrefixEvents


@dataclass(eq=False)
class KVBlock:
    """One fixed-size block of KV cache slots; identity, not value, is what compares equal."""

    block_id: int
    ref_cnt: int = 0
    # Set only while this block is the prefix-cache entry for that hash.
    block_hash: bytes | None = None


class BlockPool:
    """Owns ``num_blocks`` blocks: allocation, reference counts, LRU eviction, prefix lookups.

    Misuse that can only come from a bug in the caller (freeing a free block, caching a block
    under a second hash) raises ``RuntimeError``; asking for more blocks than are free raises
    ``ValueError`` (callers check :attr:`num_free_blocks` first).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Head = least recently freed = next to be evicted.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        # Counters for metrics; monotonic over the pool's life.
        self.num_allocated_total = 0
        self.num_evicted_total = 0
        self.placeholder: KVBlock | None = None
        # What was cached and evicted since the last heartbeat (the router's view).
        self.events = PrefixEvents(self.cached_hashes)

    def reserve_placeholder(self) -> KVBlock:
        """Pin block 0 of a fresh pool forever as the shared placeholder block.

        Its reference count stays 1, so the "free iff unreferenced" invariant needs no special
        case; every method that would change it refuses it instead.
        """
        if self.placeholder is not None or self._cached or len(self._free) != self.num_blocks:
            raise RuntimeError("reserve the placeholder on a fresh pool, once")
        if self.num_blocks < 2:
            raise ValueError("a placeholder block needs a pool of at least 2 blocks")
        block = self._free.pop(0)
        block.ref_cnt = 1
        self.placeholder = block
        return block

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all of them but the placeholder, if one is reserved."""
        return self.num_blocks - (self.placeholder is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references, including cached blocks that are eviction candidates."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (referenced or not)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks referenced by at least one request."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes."""
        if n < 0 or n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: {len(self._free)} are free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.ref_cnt != 0:
                raise RuntimeError(f"block {block.block_id} is in the free queue while in use")
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        self.num_allocated_total += n
        return out

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The block holding the KV of the full block with this chained hash, if still cached."""
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to prefix-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block is self.placeholder:
                raise RuntimeError("the placeholder block cannot be touched")
            if block.ref_cnt == 0 and self._free.pop(block.block_id, None) is None:
                raise RuntimeError(f"block {block.block_id} is unreferenced but not free")
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks that reach zero join the queue's tail.

        Pass blocks in the order they should be evicted: the first one to reach zero is evicted
        first among them.
        """
        for block in blocks:
            if block is self.placeholder:
                raise RuntimeError("the placeholder block cannot be freed")
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed while not in use")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a block whose tokens are all known under its chained hash.

        If another block already holds this hash, that mapping is kept and ``block`` stays
        uncached: there is never more than one entry per hash. It is an error to register a
        block under a second, different hash.
        """
        if not self.enable_caching:
            return
        if block is self.placeholder:
            raise RuntimeError("the placeholder block cannot be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise RuntimeError(f"block {block.block_id} is already cached under another hash")
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self.events.stored(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (returns False) while any block is in use."""
        if len(self._free) != self.num_usable_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self.events.lost()
        return True

    def cached_hashes(self) -> list[bytes]:
        """Every cached key, oldest first. Called off the engine thread (a heartbeat), so
        the keys are copied in one C-level pass, which no other thread interleaves."""
        for _ in range(8):
            try:
                return list(self._cached)
            except RuntimeError:  # resized mid-copy: only on a free-threaded build
                continue
        return []

    def free_block_ids(self) -> list[int]:
        """Ids of the free blocks in eviction order (next evicted first). O(n); for tests."""
        return list(self._free)

    def check_consistency(self) -> None:
        """Raise ``RuntimeError`` if an internal invariant is broken. O(num_blocks); for tests."""
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != (block.block_id in self._free):
                raise RuntimeError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{'is' if block.block_id in self._free else 'is not'} in the free queue"
                )
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise RuntimeError(f"block {block.block_id} has a hash the cache does not map")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"cache entry points at block {block.block_id} of another hash")
        ph = self.placeholder
        if ph is not None and (ph.ref_cnt != 1 or ph.block_hash is not None):
            raise RuntimeError(f"placeholder block {ph.block_id} was referenced or cached")

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        self.events.removed(block.block_hash)
        block.block_hash = None
        self.num_evicted_total += 1
