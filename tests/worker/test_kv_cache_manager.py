"""The KV cache manager: blocks per request, prefix hits on full blocks, nothing leaked."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hotpool.worker.engine.kv_cache_manager import KVCacheBlocks, KVCacheManager, hash_block_tokens

BS = 16


def _toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def _admit(
    m: KVCacheManager, rid: str, tokens: list[int], num_new: int | None = None
) -> tuple[KVCacheBlocks | None, int]:
    """What the scheduler does for a waiting request: look up hits, then allocate a chunk."""
    hits, n = m.get_computed_blocks(rid, tokens)
    new = m.allocate_slots(rid, tokens, n, len(tokens) - n if num_new is None else num_new, hits)
    return new, n


def test_hash_is_chained_salted_and_16_bytes() -> None:
    h = hash_block_tokens(None, [1, 2, 3], b"")
    assert len(h) == 16
    assert h == hash_block_tokens(None, (1, 2, 3), b"")
    assert h != hash_block_tokens(None, [1, 2, 4], b"")
    assert h != hash_block_tokens(None, [1, 2, 3], b"tenant")
    assert hash_block_tokens(h, [4], b"") != hash_block_tokens(None, [4], b"")
    other = hash_block_tokens(None, [9], b"")
    assert hash_block_tokens(h, [4], b"") != hash_block_tokens(other, [4], b"")


def test_kv_cache_blocks_handle() -> None:
    empty = KVCacheBlocks.empty()
    assert len(empty) == 0
    assert empty.block_ids() == []
    m = KVCacheManager(4, BS)
    new, _ = _admit(m, "a", _toks(40))
    assert new is not None
    assert len(new) == 3
    assert new.block_ids() == m.get_block_ids("a") == [0, 1, 2]


def test_allocation_covers_tokens_and_free_returns_every_block() -> None:
    m = KVCacheManager(10, BS)
    assert _admit(m, "a", _toks(40))[0] is not None
    assert len(m.get_block_ids("a")) == 3
    assert _admit(m, "b", _toks(16, 100))[0] is not None
    assert len(m.get_block_ids("b")) == 1
    assert m.num_free_blocks == 6
    assert m.usage == pytest.approx(0.4)
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == m.num_blocks == 10
    assert m.usage == 0.0
    assert m.get_block_ids("a") == []


def test_chunked_prefill_then_decode_grows_one_block_at_a_time() -> None:
    m = KVCacheManager(10, BS)
    tokens = _toks(40)
    hits, n = m.get_computed_blocks("a", tokens)
    assert n == 0
    assert len(m.allocate_slots("a", tokens, 0, 10, hits) or ()) == 1
    assert len(m.allocate_slots("a", tokens, 10, 10) or ()) == 1
    assert len(m.allocate_slots("a", tokens, 20, 20) or ()) == 1
    assert len(m.get_block_ids("a")) == 3
    for step in range(8):  # decode: 41st..48th token fill block 3, the 49th needs a 4th
        tokens.append(1000 + step)
        new = m.allocate_slots("a", tokens, len(tokens) - 1, 1)
        assert new is not None and len(new) == 0
    tokens.append(2000)
    assert len(m.allocate_slots("a", tokens, 48, 1) or ()) == 1
    assert len(m.get_block_ids("a")) == 4


def test_prefix_hit_after_a_request_with_the_same_prefix_finished() -> None:
    m = KVCacheManager(10, BS)
    first = _toks(40)
    _admit(m, "a", first)
    a_ids = m.get_block_ids("a")
    m.free("a")

    second = [*first[:32], 7, 7, 7]
    new, n = _admit(m, "b", second)
    assert n == 32
    assert m.get_block_ids("b")[:2] == a_ids[:2]
    assert new is not None and len(new) == 1
    assert m.prefix_cache_queries == 40 + 35
    assert m.prefix_cache_hits == 32


def test_hits_stop_at_the_first_differing_block() -> None:
    m = KVCacheManager(10, BS)
    _admit(m, "a", _toks(48))
    m.free("a")
    tokens = _toks(48)
    tokens[20] = 999  # block 1 differs, so block 2 cannot hit either (its chain differs)
    _, n = _admit(m, "b", tokens)
    assert n == 16


def test_a_salt_makes_identical_prefixes_miss() -> None:
    tokens = _toks(40)
    unsalted = KVCacheManager(10, BS)
    salted = KVCacheManager(10, BS, salt=b"deployment-2")
    for m in (unsalted, salted):
        _admit(m, "a", tokens)
    plain = hash_block_tokens(None, tokens[:16], b"")
    assert unsalted.pool.get_cached_block(plain) is not None
    assert salted.pool.get_cached_block(plain) is None
    assert salted.pool.get_cached_block(hash_block_tokens(None, tokens[:16], b"deployment-2"))


def test_partial_blocks_are_never_cached() -> None:
    m = KVCacheManager(10, BS)
    _admit(m, "a", _toks(20))
    assert m.pool.num_cached_blocks == 1
    m.free("a")
    _, n = _admit(m, "b", _toks(20))
    assert n == 16  # the 4 tokens of the partial block are recomputed


def test_never_all_tokens_hit() -> None:
    m = KVCacheManager(10, BS)
    _admit(m, "a", _toks(32))
    m.free("a")
    hits, n = m.get_computed_blocks("b", _toks(32))
    assert (len(hits), n) == (1, 16)  # both blocks are cached; the last is recomputed
    hits, n = m.get_computed_blocks("c", _toks(33))
    assert (len(hits), n) == (2, 32)


def test_failed_allocation_changes_nothing() -> None:
    m = KVCacheManager(4, BS)
    _admit(m, "a", _toks(48))
    before = (m.num_free_blocks, [b.ref_cnt for b in m.pool.blocks], m.pool.num_cached_blocks)
    assert _admit(m, "b", _toks(32, 500))[0] is None
    assert (m.num_free_blocks, [b.ref_cnt for b in m.pool.blocks], m.pool.num_cached_blocks) == (
        before
    )
    assert m.get_block_ids("b") == []
    m.free("b")
    m.free("a")
    assert m.num_free_blocks == 4


def test_touched_hits_no_longer_count_as_free() -> None:
    m = KVCacheManager(5, BS)
    shared = _toks(48)
    _admit(m, "a", shared)
    m.free("a")  # 3 cached blocks wait in the free queue
    _admit(m, "c", _toks(16, 500))  # takes a 4th block: 4 free, 3 of them cached
    assert m.num_free_blocks == 4

    long = [*shared, *_toks(32, 900)]  # 3 hits + 2 new blocks = 5 > 4
    hits, n = m.get_computed_blocks("b", long)
    assert n == 48
    assert m.allocate_slots("b", long, n, len(long) - n, hits) is None
    assert m.num_free_blocks == 4
    assert all(b.ref_cnt == 0 and b.block_hash is not None for b in hits.blocks)

    shorter = [*shared, *_toks(16, 900)]  # 3 hits + 1 new block = 4
    new, n = _admit(m, "d", shorter)
    assert n == 48
    assert new is not None and len(new) == 1
    assert m.num_free_blocks == 0


def test_new_blocks_never_evict_the_requests_own_hits() -> None:
    m = KVCacheManager(2, BS)
    _admit(m, "a", _toks(16))
    _admit(m, "x", _toks(16, 500))
    m.free("a")
    m.free("x")
    assert m.pool.free_block_ids() == [0, 1]  # a's cached block is next to be evicted
    new, n = _admit(m, "b", _toks(24))
    assert n == 16
    assert new is not None and new.block_ids() == [1]
    assert m.get_block_ids("b") == [0, 1]
    assert [b.ref_cnt for b in m.pool.blocks] == [1, 1]


def test_shared_prefix_blocks_are_referenced_twice() -> None:
    m = KVCacheManager(10, BS)
    prefix = _toks(32)
    _admit(m, "a", [*prefix, 1, 2, 3])
    new, n = _admit(m, "b", [*prefix, 4, 5])
    assert n == 32
    assert new is not None and len(new) == 1
    shared = m.get_block_ids("a")[:2]
    assert m.get_block_ids("b")[:2] == shared
    assert [m.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert m.num_free_blocks == 10 - 4

    m.free("a")
    assert [m.pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert not set(shared) & set(m.pool.free_block_ids())
    m.free("b")
    assert m.num_free_blocks == 10


def test_free_releases_the_tail_first() -> None:
    m = KVCacheManager(3, BS)
    _admit(m, "a", _toks(48))
    ids = m.get_block_ids("a")
    m.free("a")
    assert m.pool.free_block_ids() == ids[::-1]
    # A newcomer evicts the sequence's last block, keeping its shared prefix cached.
    _admit(m, "b", _toks(16, 500))
    assert m.get_block_ids("b") == [ids[-1]]
    _, n = _admit(m, "c", _toks(40))
    assert n == 32


def test_preempted_request_gets_hits_for_its_own_blocks() -> None:
    m = KVCacheManager(10, BS)
    tokens = _toks(30)
    _admit(m, "a", tokens)
    for t in range(10):  # decode up to 40 tokens; block 1 fills at 32
        tokens.append(500 + t)
        m.allocate_slots("a", tokens, len(tokens) - 1, 1)
    m.free("a")  # preempted
    _, n = _admit(m, "a", tokens)
    assert n == 32


def test_stale_hits_are_refused() -> None:
    m = KVCacheManager(2, BS)
    _admit(m, "a", _toks(20))
    m.free("a")
    hits, n = m.get_computed_blocks("b", _toks(20))
    assert n == 16
    _admit(m, "c", _toks(32, 500))  # evicts the hit in between: a scheduler bug
    m.free("c")
    with pytest.raises(RuntimeError, match="evicted"):
        m.allocate_slots("b", _toks(20), n, 4, hits)


def test_caching_disabled() -> None:
    m = KVCacheManager(10, BS, enable_caching=False)
    _admit(m, "a", _toks(40))
    m.free("a")
    _, n = _admit(m, "b", _toks(40))
    assert n == 0
    assert m.pool.num_cached_blocks == 0
    assert m.prefix_cache_queries == 0


def test_reset_prefix_cache() -> None:
    m = KVCacheManager(10, BS)
    _admit(m, "a", _toks(40))
    assert m.reset_prefix_cache() is False
    m.free("a")
    assert m.reset_prefix_cache() is True
    _, n = _admit(m, "b", _toks(40))
    assert n == 0


def test_unknown_request_free_is_a_no_op() -> None:
    m = KVCacheManager(2, BS)
    m.free("nobody")
    assert m.num_free_blocks == 2


def test_prefix_hits_only_on_a_first_allocation() -> None:
    m = KVCacheManager(10, BS)
    _admit(m, "a", _toks(32))
    hits, _ = m.get_computed_blocks("b", _toks(40))
    m.allocate_slots("b", _toks(40), 0, 8)
    with pytest.raises(RuntimeError, match="first step"):
        m.allocate_slots("b", _toks(40), 16, 24, hits)


VOCAB = st.integers(0, 2)  # a tiny vocabulary so prefixes repeat


class ManagerMachine(RuleBasedStateMachine):
    """A scheduler-shaped random walk: admit, run chunks, decode, preempt, finish, reset.

    Besides the pool's bookkeeping it tracks what each block "contains" (the token prefix its
    KV depends on, as written by the last request that computed it) and checks that every
    prefix hit hands out a block holding exactly the request's tokens. With a sliding window,
    only the blocks a query can still read must be real, and those must hold the right KV.
    """

    @initialize(
        num_blocks=st.integers(4, 16),
        block_size=st.sampled_from([1, 2, 4]),
        window=st.none() | st.integers(1, 12),
    )
    def setup(self, num_blocks: int, block_size: int, window: int | None) -> None:
        self.m = KVCacheManager(num_blocks, block_size, salt=b"s", sliding_window=window)
        self.window = window
        self.ph = self.m.pool.placeholder
        self.bs = block_size
        self.running: dict[str, tuple[list[int], int]] = {}  # id -> tokens, computed
        self.waiting: dict[str, list[int]] = {}
        self.content: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def _snapshot(self) -> tuple[object, ...]:
        pool = self.m.pool
        return (
            pool.free_block_ids(),
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {rid: self.m.get_block_ids(rid) for rid in self.running},
        )

    def _ran(self, rid: str, tokens: list[int], computed: int) -> None:
        """The forward pass wrote KV for tokens[:computed] into the request's blocks."""
        for j, block_id in enumerate(self.m.get_block_ids(rid)):
            if j * self.bs < computed and not self._is_placeholder(block_id):
                self.content[block_id] = tuple(tokens[: min((j + 1) * self.bs, computed)])
        self.running[rid] = (tokens, computed)

    def _try_admit(self, rid: str, tokens: list[int], chunk: int) -> bool:
        hits, n = self.m.get_computed_blocks(rid, tokens)
        assert n == len(hits) * self.bs
        assert n < len(tokens)
        for i, block in enumerate(hits.blocks):
            if block is self.ph:  # only outside the window of the token at n
                assert self.window is not None and (i + 1) * self.bs <= n - self.window + 1
                continue
            assert self.content.get(block.block_id) == tuple(tokens[: (i + 1) * self.bs])
        num_new = min(chunk, len(tokens) - n)
        before = self._snapshot()
        if self.m.allocate_slots(rid, tokens, n, num_new, hits) is None:
            assert self._snapshot() == before
            return False
        self._ran(rid, tokens, n + num_new)
        return True

    @rule(tokens=st.lists(VOCAB, min_size=1, max_size=24), chunk=st.integers(1, 24))
    def add(self, tokens: list[int], chunk: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        if not self._try_admit(rid, tokens, chunk):
            self.waiting[rid] = tokens

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 24))
    def readmit(self, i: int, chunk: int) -> None:
        rid = sorted(self.waiting)[i % len(self.waiting)]
        if self._try_admit(rid, self.waiting[rid], chunk):
            del self.waiting[rid]

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 24), token=VOCAB)
    def step(self, i: int, chunk: int, token: int) -> None:
        rid = sorted(self.running)[i % len(self.running)]
        tokens, computed = self.running[rid]
        if computed == len(tokens):  # decode: the last sampled token joins the sequence
            tokens = [*tokens, token]
        num_new = min(chunk, len(tokens) - computed)
        before = self._snapshot()
        if self.m.allocate_slots(rid, tokens, computed, num_new) is None:
            assert self._snapshot() == before
            self.m.free(rid)  # preempt by recompute
            del self.running[rid]
            self.waiting[rid] = tokens
            return
        self._ran(rid, tokens, computed + num_new)

    @precondition(lambda self: self.running or self.waiting)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        rids = sorted([*self.running, *self.waiting])
        rid = rids[i % len(rids)]
        self.m.free(rid)
        self.running.pop(rid, None)
        self.waiting.pop(rid, None)

    def _is_placeholder(self, block_id: int) -> bool:
        return self.ph is not None and block_id == self.ph.block_id

    @rule()
    def reset(self) -> None:
        idle = not self.running
        assert self.m.reset_prefix_cache() is idle
        if idle:
            assert self.m.pool.num_cached_blocks == 0

    @invariant()
    def consistent(self) -> None:
        m = self.m
        pool = m.pool
        m.check_consistency()
        free = set(pool.free_block_ids())
        referenced = set()
        for rid, (tokens, computed) in self.running.items():
            ids = m.get_block_ids(rid)
            assert len(ids) == -(-computed // self.bs)
            # Blocks the next query (at `computed`) reads must be real and hold this KV.
            first_read = 0 if self.window is None else max(0, computed - self.window + 1)
            for j, block_id in enumerate(ids):
                if self._is_placeholder(block_id):
                    assert (j + 1) * self.bs <= first_read
                    continue
                assert self.content[block_id] == tuple(tokens[: min((j + 1) * self.bs, computed)])
                referenced.add(block_id)
        for rid in self.waiting:
            assert m.get_block_ids(rid) == []
        for block in pool.blocks:
            if block is self.ph:
                assert block.ref_cnt == 1 and block.block_hash is None
                assert block.block_id not in free
                continue
            assert block.ref_cnt >= 0
            assert not (block.block_id in free and block.ref_cnt > 0)
            assert (block.ref_cnt > 0) == (block.block_id in referenced)
            if block.block_hash is not None:
                assert pool.get_cached_block(block.block_hash) is block
        assert len(free) + len(referenced) == m.num_blocks
        assert pool.num_blocks == m.num_blocks + (self.ph is not None)
        assert m.num_free_blocks == len(free)

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for rid in [*self.running, *self.waiting]:
            self.m.free(rid)
        assert self.m.num_free_blocks == self.m.num_blocks


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
