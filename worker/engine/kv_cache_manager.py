"""The KV cache manager: which blocks each request owns, and prefix caching over full blocks.

Pure Python (no torch). The scheduler sees blocks only through the opaque
:class:`KVCacheBlocks` handle and block ids; the model runner turns the ids into block tables
and slot mappings.

Contract with the scheduler, per request (all counts in tokens; ``token_ids`` is every token
known so far, prompt + outputs, and only ever grows):

1. **Admission** — each time the scheduler tries to admit a waiting request (first
   arrival or re-admission after preemption), call :meth:`KVCacheManager.get_computed_blocks`
   and, in the same step with no other allocation in between, :meth:`~KVCacheManager.allocate_slots`
   with ``num_computed_tokens`` = the hit tokens it returned and ``new_computed_blocks`` = the
   hit blocks. A hit never covers every token: at least one is left to compute so the step
   produces logits. If allocation returns ``None`` nothing changed; the request stays waiting
   and the next attempt starts again at ``get_computed_blocks``.
2. **Every step the request runs** — call ``allocate_slots(request_id, token_ids,
   num_computed_tokens, num_new_tokens)`` before running it (a prefill chunk or one decode
   token). ``None`` means the pool is short: preempt someone and retry, or skip the request.
   On success, every block that becomes full within ``token_ids[:num_computed + num_new]`` is
   registered in the prefix cache *now*, before its KV is written. That is sound because the
   forward pass writes each layer's new K/V into the cache before that layer's attention reads
   it, so a request admitted later in the same step may already hit those blocks. Therefore
   the step's forward must run for every request whose allocation succeeded; if a forward
   fails, reset the prefix cache (after freeing) since cached blocks may hold garbage.
3. **Finish, abort or preemption** — call :meth:`~KVCacheManager.free`. Blocks are released
   tail first, so a sequence's last blocks are evicted before its shared prefix. A preempted
   request recomputes from scratch: set its ``num_computed_tokens`` to 0 and re-admit it via
   step 1, where it gets prefix hits for its own earlier full blocks if they were not evicted.
   Free also forgets the request's cached hashes, so call it for a request that only ever
   reached ``get_computed_blocks`` as well (unknown ids are a no-op).

**Sliding window** (``sliding_window=W``, every layer attends only to the W most recent keys: a
query at position p reads keys k with p - W < k <= p). A step whose first new token is at
position c = ``num_computed_tokens`` has no present or future query reading a key before
c - W + 1, so ``allocate_slots`` releases every block lying wholly before it, the first
``max(0, c - W + 1) // block_size`` entries of the table, before it counts the free blocks the
step needs. A released block goes back to the free queue with its hash, like a freed one. Its
table entry then points at one shared placeholder block (block 0, pinned by the pool), so
``get_block_ids`` keeps one entry per block the sequence spans and the slot of every live
position is unchanged. The model's attention must mask keys outside the window: the
placeholder's slots hold no one's KV. A prefix hit of n blocks needs only what the first
new token (position n * block_size) reads, the blocks covering positions from
n * block_size - W + 1 on; earlier blocks of the hit may have been evicted and are placeholders.
:attr:`KVCacheManager.num_blocks` and ``usage`` leave the placeholder out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from hotpool.worker.engine.block_pool import BlockPool, KVBlock


@dataclass(frozen=True)
class KVCacheBlocks:
    """An opaque, immutable list of blocks that the scheduler hands back to the manager."""

    blocks: tuple[KVBlock, ...]

    @classmethod
    def empty(cls) -> KVCacheBlocks:
        return _EMPTY

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


_EMPTY = KVCacheBlocks(())


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], salt: bytes) -> bytes:
    """Chained 16-byte hash of one full block: its parent block's hash, its tokens, the salt.

    The encoding is unambiguous: the salt is length-prefixed and a marker byte tells a root
    block from a child, so no two distinct inputs share a byte string. Token ids are packed as
    native 64-bit integers; hashes never leave the process, so endianness does not matter.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(len(salt).to_bytes(8, "little"))
    h.update(salt)
    if parent is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01")
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheManager:
    """Allocates blocks to requests and finds the longest cached prefix of a new request.

    ``sliding_window`` (tokens, or ``None`` for full attention) turns on the window rules of
    the module docstring and reserves one of the ``num_blocks`` pool blocks as the placeholder.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        salt: bytes = b"",
        sliding_window: int | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, int)
            or sliding_window <= 0
        ):
            raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.salt = salt
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self._placeholder = self.pool.reserve_placeholder() if sliding_window else None
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # Chained hashes of the request's full blocks, computed once each.
        self._req_hashes: dict[str, list[bytes]] = {}
        # How many of the request's leading blocks have been offered to the prefix cache.
        self._num_cached: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold: the pool's, less the placeholder under a sliding window."""
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int]
    ) -> tuple[KVCacheBlocks, int]:
        """The longest run of cached full blocks prefixing ``token_ids``, and its token count.

        Leaves at least one token uncovered. Takes no references (``allocate_slots`` does).
        """
        if not self.enable_caching or not token_ids:
            return _EMPTY, 0
        hashes = self._block_hashes(request_id, token_ids, len(token_ids))
        max_blocks = (len(token_ids) - 1) // self.block_size
        if self._placeholder is not None and self.sliding_window is not None:
            hits = self._window_hit(hashes[:max_blocks], self._placeholder, self.sliding_window)
        else:
            hits = []
            for block_hash in hashes[:max_blocks]:
                block = self.pool.get_cached_block(block_hash)
                if block is None:
                    break
                hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_hit_tokens
        return KVCacheBlocks(tuple(hits)), num_hit_tokens

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Make the request own blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        ``new_computed_blocks`` (first allocation only) are the prefix hits from
        :meth:`get_computed_blocks`, already counted in ``num_computed_tokens``. Returns the
        newly allocated blocks (possibly none), or ``None`` with nothing changed when the pool
        is short, even when blocks outside the window would have been released.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError("token counts must be non-negative")
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        held = self._req_blocks.get(request_id, [])
        if hits:
            if held:
                raise RuntimeError(f"request {request_id} got prefix hits after its first step")
            if num_computed_tokens < len(hits) * self.block_size:
                raise ValueError("num_computed_tokens must include the prefix-hit tokens")
            if self.enable_caching:
                self._check_hits_still_cached(request_id, token_ids, hits)

        num_tokens = num_computed_tokens + num_new_tokens
        num_required = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_required - len(held) - len(hits))
        ph = self._placeholder
        first_dying = 0
        dying: list[KVBlock] = []
        if ph is not None:
            num_dead = self._num_dead_blocks(num_computed_tokens)
            # Hits before the window are never read: they stay placeholders, untouched.
            hits = (ph,) * min(num_dead, len(hits)) + hits[num_dead:]
            # Released entries are a leading run of placeholders, so the walk back is short.
            end = first_dying = min(num_dead, len(held))
            while first_dying > 0 and held[first_dying - 1] is not ph:
                first_dying -= 1
            dying = held[first_dying:end]
        real_hits = [b for b in hits if b is not ph]
        # Hits that sit in the free queue stop being free once touched; blocks that leave the
        # window and that no one else holds become free before the new ones are taken.
        num_hits_free = sum(1 for b in real_hits if b.ref_cnt == 0)
        num_released = sum(1 for b in dying if b.ref_cnt == 1)
        if num_new_blocks + num_hits_free > self.pool.num_free_blocks + num_released:
            return None

        if ph is not None and dying:
            held[first_dying : first_dying + len(dying)] = [ph] * len(dying)
            # In position order, as decoding releases them one at a time: earliest evicted first.
            self.pool.free_blocks(dying)
        # Touch before allocating so the new blocks cannot evict the hits.
        self.pool.touch(real_hits)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks = self._req_blocks.setdefault(request_id, [])
        blocks.extend(hits)
        blocks.extend(new_blocks)
        num_cached = self._num_cached.setdefault(request_id, len(hits))

        if self.enable_caching:
            num_known = min(num_tokens, len(token_ids))
            num_full = num_known // self.block_size
            if num_full > num_cached:
                hashes = self._block_hashes(request_id, token_ids, num_known)
                for i in range(num_cached, num_full):
                    if blocks[i] is not ph:
                        self.pool.cache_full_block(blocks[i], hashes[i])
                self._num_cached[request_id] = num_full
        return KVCacheBlocks(tuple(new_blocks))

    def free(self, request_id: str) -> None:
        """Release every block of the request, last block first, and forget the request."""
        blocks = self._req_blocks.pop(request_id, [])
        self._req_hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        ph = self._placeholder
        self.pool.free_blocks(b for b in reversed(blocks) if b is not ph)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty for a request holding no blocks)."""
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    def check_consistency(self) -> None:
        """Raise ``RuntimeError`` if pool or request bookkeeping is inconsistent. For tests."""
        self.pool.check_consistency()
        ph = self._placeholder
        refs: dict[int, int] = {}
        for request_id, blocks in self._req_blocks.items():
            real = [b for b in blocks if b is not ph]
            if blocks[len(blocks) - len(real) :] != real:
                raise RuntimeError(f"request {request_id} has a placeholder after a live block")
            if len({b.block_id for b in real}) != len(real):
                raise RuntimeError(f"request {request_id} holds a block twice")
            for b in real:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if block is not ph and block.ref_cnt != refs.get(block.block_id, 0):
                raise RuntimeError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{refs.get(block.block_id, 0)} requests hold it"
                )

    def _block_hashes(
        self, request_id: str, token_ids: Sequence[int], num_known: int
    ) -> list[bytes]:
        """The request's chained hashes, extended to every full block of its first tokens."""
        hashes = self._req_hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_known // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], self.salt))
        return hashes

    def _num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks wholly before c - W + 1, which no query from position c on reads."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _window_hit(self, hashes: Sequence[bytes], ph: KVBlock, window: int) -> list[KVBlock]:
        """The longest hit whose first new token finds every key of its window cached.

        A hit of n blocks starts computing at c = n * bs, which reads keys from c - W + 1 on:
        the hit's last ceil((W - 1) / bs) blocks, or all n of them when n is smaller. Scanning
        from the right, the first run of that many cached blocks ends the longest hit; without
        one, only a run from block 0 can hit. At least one block must be cached (vLLM's rule
        too), so a window of 1 does not claim hits on an empty cache.
        """
        need = max(1, -(-(window - 1) // self.block_size))
        run: list[KVBlock] = []  # cached blocks right of the scan, nearest first
        for i in range(len(hashes) - 1, -1, -1):
            block = self.pool.get_cached_block(hashes[i])
            if block is None:
                run.clear()
                continue
            run.append(block)
            if len(run) == need:
                return [ph] * i + run[::-1]
        return run[::-1]

    def _check_hits_still_cached(
        self, request_id: str, token_ids: Sequence[int], hits: tuple[KVBlock, ...]
    ) -> None:
        # A hit evicted between get_computed_blocks and allocate_slots would hand the request
        # someone else's KV; that can only happen if the scheduler allocated in between.
        hashes = self._block_hashes(request_id, token_ids, len(token_ids))
        for i, block in enumerate(hits):
            if block is self._placeholder:
                continue  # outside the window: nothing of it is read
            if i >= len(hashes) or block.block_hash != hashes[i]:
                raise RuntimeError(
                    f"prefix hit block {block.block_id} of request {request_id} was evicted "
                    "before allocate_slots; call get_computed_blocks again"
                )
