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
    """Allocates blocks to requests and finds the longest cached prefix of a new request."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        salt: bytes = b"",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.salt = salt
        self.pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # Chained hashes of the request's full blocks, computed once each.
        self._req_hashes: dict[str, list[bytes]] = {}
        # How many of the request's leading blocks have been offered to the prefix cache.
        self._num_cached: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

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
        hits: list[KVBlock] = []
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
        is short.
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
        # Hits that sit in the free queue stop being free once touched.
        num_hits_free = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + num_hits_free > self.pool.num_free_blocks:
            return None

        # Touch before allocating so the new blocks cannot evict the hits.
        self.pool.touch(hits)
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
                    self.pool.cache_full_block(blocks[i], hashes[i])
                self._num_cached[request_id] = num_full
        return KVCacheBlocks(tuple(new_blocks))

    def free(self, request_id: str) -> None:
        """Release every block of the request, last block first, and forget the request."""
        blocks = self._req_blocks.pop(request_id, [])
        self._req_hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty for a request holding no blocks)."""
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    def check_consistency(self) -> None:
        """Raise ``RuntimeError`` if pool or request bookkeeping is inconsistent. For tests."""
        self.pool.check_consistency()
        refs: dict[int, int] = {}
        for request_id, blocks in self._req_blocks.items():
            if len({b.block_id for b in blocks}) != len(blocks):
                raise RuntimeError(f"request {request_id} holds a block twice")
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
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

    def _check_hits_still_cached(
        self, request_id: str, token_ids: Sequence[int], hits: tuple[KVBlock, ...]
    ) -> None:
        # A hit evicted between get_computed_blocks and allocate_slots would hand the request
        # someone else's KV; that can only happen if the scheduler allocated in between.
        hashes = self._block_hashes(request_id, token_ids, len(token_ids))
        for i, block in enumerate(hits):
            if i >= len(hashes) or block.block_hash != hashes[i]:
                raise RuntimeError(
                    f"prefix hit block {block.block_id} of request {request_id} was evicted "
                    "before allocate_slots; call get_computed_blocks again"
                )
