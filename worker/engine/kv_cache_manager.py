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

**Layer groups** (``windows=``, one entry per group of ``kv_groups``): a model that mixes full
and sliding layers keeps one block table per group, all drawn from the one pool. Every group
of a request spans the same positions, so the tables have equal lengths; the sliding groups'
tables release blocks behind their window as above while the full groups keep theirs. A
prefix hit must hold in every group; each group's blocks are cached under the chained hash
tagged with the group, since its pages hold other layers' KV. Allocation is all or nothing
across groups.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hotpool.worker.engine.block_pool import BlockPool, KVBlock
from hotpool.worker.prefix_hash import hash_block_tokens


@dataclass(frozen=True)
class KVCacheBlocks:
    """An opaque, immutable set of blocks that the scheduler hands back to the manager: one
    tuple per layer group, each as long as the others (one entry per block position)."""

    groups: tuple[tuple[KVBlock, ...], ...]

    @classmethod
    def empty(cls) -> KVCacheBlocks:
        return _EMPTY

    @property
    def blocks(self) -> tuple[KVBlock, ...]:
        """The first group's blocks (a single-group model's only ones)."""
        return self.groups[0] if self.groups else ()

    def block_ids(self, group: int = 0) -> list[int]:
        return [b.block_id for b in self.groups[group]] if self.groups else []

    def __len__(self) -> int:
        return len(self.blocks)


_EMPTY = KVCacheBlocks(())


def _group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of ``group``: each group's pages hold other layers' KV,
    so the same tokens are a different entry in each (17 bytes past group 0: never equal)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(1, "little")


def _check_window(window: object) -> None:
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window <= 0
    ):
        raise ValueError(f"sliding_window must be a positive int, got {window!r}")


class KVCacheManager:
    """Allocates blocks to requests and finds the longest cached prefix of a new request.

    ``windows`` gives one entry per layer group (see ``kv_groups``): the group's sliding
    window in tokens, or ``None`` for full attention. ``sliding_window=W`` is the one-group
    shorthand ``windows=(W,)``. Any window turns on the window rules of the module docstring
    for its group and reserves one of the ``num_blocks`` pool blocks as the placeholder.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        salt: bytes = b"",
        sliding_window: int | None = None,
        *,
        windows: Sequence[int | None] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if windows is None:
            windows = (sliding_window,)
        elif sliding_window is not None:
            raise ValueError("give sliding_window or windows, not both")
        if not windows or len(windows) > 256:
            raise ValueError(f"1 to 256 layer groups, got {len(windows)}")
        for window in windows:
            _check_window(window)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.salt = salt
        self.windows: tuple[int | None, ...] = tuple(windows)
        self.pool = BlockPool(num_blocks, enable_caching)
        self._placeholder = (
            self.pool.reserve_placeholder() if any(w is not None for w in windows) else None
        )
        self._groups = range(len(self.windows))
        # Per request, per group: its block table (placeholders for released positions).
        self._req_blocks: dict[str, list[list[KVBlock]]] = {}
        # Chained hashes of the request's full blocks, computed once each (shared by groups).
        self._req_hashes: dict[str, list[bytes]] = {}
        # How many of the request's leading blocks have been offered to the prefix cache.
        self._num_cached: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def sliding_window(self) -> int | None:
        """The window of a one-group model (None: full attention, or several groups)."""
        return self.windows[0] if len(self.windows) == 1 else None

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

    def blocks_held_at_most(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of ``num_tokens`` tokens holds at once, over every group,
        computed ``max_chunk`` tokens a step at most: a sliding group holds its window, a
        chunk and two partial blocks; a full group, every block."""
        bs = self.block_size
        total = 0
        for window in self.windows:
            tokens = num_tokens if window is None else min(num_tokens, window + max_chunk + 2 * bs)
            total += -(-tokens // bs)
        return total

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int]
    ) -> tuple[KVCacheBlocks, int]:
        """The longest run of cached full blocks prefixing ``token_ids`` in every group, and
        its token count.

        Leaves at least one token uncovered. Takes no references (``allocate_slots`` does).
        A hit must hold in every group: the full groups' hits are prefix-closed, while a
        sliding group's hit of n blocks needs the blocks its window reads before n, so the
        length shrinks to a fixpoint (each group asked again for the shorter length).
        """
        if not self.enable_caching or not token_ids:
            return _EMPTY, 0
        hashes = self._block_hashes(request_id, token_ids, len(token_ids))
        n = (len(token_ids) - 1) // self.block_size
        while True:
            hits = [self._group_hit(g, hashes, n) for g in self._groups]
            m = min(len(h) for h in hits)
            if all(len(h) == m or self.windows[g] is None for g, h in enumerate(hits)):
                break
            n = m
        num_hit_tokens = m * self.block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_hit_tokens
        if m == 0:
            return _EMPTY, 0
        return KVCacheBlocks(tuple(tuple(h[:m]) for h in hits)), num_hit_tokens

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Make the request own blocks for ``num_computed_tokens + num_new_tokens`` tokens in
        every group.

        ``new_computed_blocks`` (first allocation only) are the prefix hits from
        :meth:`get_computed_blocks`, already counted in ``num_computed_tokens``. Returns the
        newly allocated blocks (possibly none), or ``None`` with nothing changed when the pool
        is short, even when blocks outside the window would have been released.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError("token counts must be non-negative")
        groups = self._groups
        given = new_computed_blocks.groups if new_computed_blocks is not None else ()
        all_hits = given or ((),) * len(groups)
        if len(all_hits) != len(groups):
            raise ValueError(f"prefix hits for {len(all_hits)} groups, the cache has {len(groups)}")
        held_all = self._req_blocks.get(request_id)
        num_hits = len(all_hits[0])
        if num_hits:
            if held_all is not None and any(held_all):
                raise RuntimeError(f"request {request_id} got prefix hits after its first step")
            if num_computed_tokens < num_hits * self.block_size:
                raise ValueError("num_computed_tokens must include the prefix-hit tokens")
            if self.enable_caching:
                self._check_hits_still_cached(request_id, token_ids, all_hits)

        num_tokens = num_computed_tokens + num_new_tokens
        num_required = -(-num_tokens // self.block_size)
        ph = self._placeholder
        plans: list[tuple[tuple[KVBlock, ...], int, int, list[KVBlock]]] = []
        num_take = 0  # blocks leaving the free queue: new ones and free hits
        num_released = 0  # blocks joining it: the last reference behind a window
        for g in groups:
            held = held_all[g] if held_all is not None else []
            hits = all_hits[g]
            num_new_blocks = max(0, num_required - len(held) - len(hits))
            first_dying = 0
            dying: list[KVBlock] = []
            if ph is not None and self.windows[g] is not None:
                num_dead = self._num_dead_blocks(num_computed_tokens, self.windows[g])
                # Hits before the window are never read: they stay placeholders, untouched.
                hits = (ph,) * min(num_dead, len(hits)) + hits[num_dead:]
                # Released entries are a leading run of placeholders, so the walk back is short.
                end = first_dying = min(num_dead, len(held))
                while first_dying > 0 and held[first_dying - 1] is not ph:
                    first_dying -= 1
                dying = held[first_dying:end]
            # Hits that sit in the free queue stop being free once touched; blocks that leave
            # the window and that no one else holds become free before the new ones are taken.
            num_take += num_new_blocks + sum(1 for b in hits if b is not ph and b.ref_cnt == 0)
            num_released += sum(1 for b in dying if b.ref_cnt == 1)
            plans.append((hits, num_new_blocks, first_dying, dying))
        if num_take > self.pool.num_free_blocks + num_released:
            return None

        if held_all is None:
            held_all = self._req_blocks[request_id] = [[] for _ in groups]
        # Released blocks in position order (as decoding releases them one at a time),
        # interleaved over groups: the earliest positions are evicted first, in every group.
        dying_all = [plan[3] for plan in plans]
        for g, (_, _, first, dying) in enumerate(plans):
            if dying:
                held_all[g][first : first + len(dying)] = [ph] * len(dying)  # type: ignore[list-item]
        self.pool.free_blocks(_interleave(dying_all))
        # Touch every group's hits before allocating so the new blocks cannot evict them.
        for hits, *_ in plans:
            self.pool.touch(b for b in hits if b is not ph)
        new_groups: list[tuple[KVBlock, ...]] = []
        for g, (hits, num_new_blocks, _, _) in enumerate(plans):
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            held_all[g].extend(hits)
            held_all[g].extend(new_blocks)
            new_groups.append(tuple(new_blocks))
        num_cached = self._num_cached.setdefault(request_id, num_hits)

        if self.enable_caching:
            num_known = min(num_tokens, len(token_ids))
            num_full = num_known // self.block_size
            if num_full > num_cached:
                hashes = self._block_hashes(request_id, token_ids, num_known)
                for g in groups:
                    blocks = held_all[g]
                    for i in range(num_cached, num_full):
                        if blocks[i] is not ph:
                            self.pool.cache_full_block(blocks[i], _group_key(hashes[i], g))
                self._num_cached[request_id] = num_full
        return KVCacheBlocks(tuple(new_groups))

    def free(self, request_id: str) -> None:
        """Release every block of the request, last block first (in every group), and forget
        the request."""
        held = self._req_blocks.pop(request_id, None)
        self._req_hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if held:
            ph = self._placeholder
            tail_first = _interleave([blocks[::-1] for blocks in held])
            self.pool.free_blocks(b for b in tail_first if b is not ph)

    def free_tail(self, request_id: str, num_tokens: int) -> int:
        """Keep only the blocks covering the request's first ``num_tokens`` tokens, in every
        group, and free the rest, last first; returns how many were freed.

        For speculative decoding: slots allocated for proposed tokens that verification
        rejected go back. Prefix hashes are untouched: ``allocate_slots`` registers a block
        only once every token in it is known (``token_ids``), and proposals are not passed as
        known tokens, so no freed block was ever registered for them.
        """
        held = self._req_blocks.get(request_id)
        if not held:
            return 0
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
        keep = -(-num_tokens // self.block_size)
        tails = [blocks[keep:] for blocks in held]
        for blocks in held:
            del blocks[keep:]
        ph = self._placeholder
        freed = [b for b in _interleave([t[::-1] for t in tails]) if b is not ph]
        self.pool.free_blocks(freed)
        if self._num_cached.get(request_id, 0) > keep:
            self._num_cached[request_id] = keep
        return len(freed)

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table in ``group`` (empty for a request holding no blocks)."""
        held = self._req_blocks.get(request_id)
        return [b.block_id for b in held[group]] if held else []

    def get_group_block_ids(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's block table in every group, in group order."""
        held = self._req_blocks.get(request_id)
        if not held:
            return ((),) * len(self._groups)
        return tuple(tuple(b.block_id for b in blocks) for blocks in held)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    def check_consistency(self) -> None:
        """Raise ``RuntimeError`` if pool or request bookkeeping is inconsistent. For tests."""
        self.pool.check_consistency()
        ph = self._placeholder
        refs: dict[int, int] = {}
        for request_id, held in self._req_blocks.items():
            if len({len(blocks) for blocks in held}) > 1:
                raise RuntimeError(f"request {request_id} has groups of different lengths")
            owners: set[int] = set()
            for g, blocks in enumerate(held):
                real = [b for b in blocks if b is not ph]
                if real and self.windows[g] is None and len(real) != len(blocks):
                    raise RuntimeError(f"request {request_id} has a placeholder in a full group")
                if blocks[len(blocks) - len(real) :] != real:
                    raise RuntimeError(f"request {request_id} has a placeholder after a live block")
                ids = {b.block_id for b in real}
                if len(ids) != len(real) or ids & owners:
                    raise RuntimeError(f"request {request_id} holds a block twice")
                owners |= ids
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

    def _num_dead_blocks(self, num_computed_tokens: int, window: int) -> int:
        """Leading blocks wholly before c - W + 1, which no query from position c on reads."""
        return max(0, num_computed_tokens - window + 1) // self.block_size

    def _group_hit(self, group: int, hashes: Sequence[bytes], max_blocks: int) -> list[KVBlock]:
        """The longest hit of at most ``max_blocks`` blocks that ``group`` alone could take."""
        window = self.windows[group]
        pool = self.pool
        if window is not None and self._placeholder is not None:
            return self._window_hit(group, hashes[:max_blocks], self._placeholder, window)
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = pool.get_cached_block(_group_key(block_hash, group))
            if block is None:
                break
            hits.append(block)
        return hits

    def _window_hit(
        self, group: int, hashes: Sequence[bytes], ph: KVBlock, window: int
    ) -> list[KVBlock]:
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
            block = self.pool.get_cached_block(_group_key(hashes[i], group))
            if block is None:
                run.clear()
                continue
            run.append(block)
            if len(run) == need:
                return [ph] * i + run[::-1]
        return run[::-1]

    def _check_hits_still_cached(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hits: Sequence[tuple[KVBlock, ...]],
    ) -> None:
        # A hit evicted between get_computed_blocks and allocate_slots would hand the request
        # someone else's KV; that can only happen if the scheduler allocated in between.
        hashes = self._block_hashes(request_id, token_ids, len(token_ids))
        for g, group_hits in enumerate(hits):
            if len(group_hits) != len(hits[0]):
                raise ValueError("prefix hits must cover as many blocks in every group")
            for i, block in enumerate(group_hits):
                if block is self._placeholder:
                    continue  # outside the window: nothing of it is read
                if i >= len(hashes) or block.block_hash != _group_key(hashes[i], g):
                    raise RuntimeError(
                        f"prefix hit block {block.block_id} of request {request_id} was evicted "
                        "before allocate_slots; call get_computed_blocks again"
                    )


def _interleave(lists: Sequence[Sequence[KVBlock]]) -> Iterator[KVBlock]:
    """Position 0 of every list, then position 1 of every list, and so on."""
    for i in range(max((len(x) for x in lists), default=0)):
        for blocks in lists:
            if i < len(blocks):
                yield blocks[i]
