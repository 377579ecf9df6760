"""The block pool: ref counts, a least-recently-freed eviction order, one cache entry per hash."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hotpool.worker.engine.block_pool import BlockPool, KVBlock

H1, H2, H3 = b"h1" * 8, b"h2" * 8, b"h3" * 8


def test_new_pool_is_all_free() -> None:
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    assert pool.free_block_ids() == [0, 1, 2, 3]


def test_allocation_takes_blocks_and_free_returns_them() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage == 0.75
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    assert pool.num_allocated_total == 3


def test_asking_for_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="1 are free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert pool.get_new_blocks(0) == []


def test_eviction_takes_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    b = pool.get_new_blocks(4)
    pool.free_blocks([b[2], b[0]])
    pool.free_blocks([b[3]])
    pool.free_blocks([b[1]])
    assert pool.free_block_ids() == [2, 0, 3, 1]
    assert [x.block_id for x in pool.get_new_blocks(4)] == [2, 0, 3, 1]


def test_freed_block_stays_a_cache_hit_until_evicted() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, H1)
    pool.free_blocks([a, b])
    assert pool.get_cached_block(H1) is a
    assert pool.num_cached_blocks == 1

    (again,) = pool.get_new_blocks(1)  # the LRU head is `a`: its hash goes
    assert again is a
    assert a.block_hash is None
    assert pool.get_cached_block(H1) is None
    assert pool.num_evicted_total == 1


def test_touch_revives_a_free_cached_block() -> None:
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, H1)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3

    pool.touch([pool.get_cached_block(H1)])  # type: ignore[list-item]
    assert a.ref_cnt == 1
    assert pool.num_free_blocks == 2
    assert 0 not in pool.free_block_ids()
    # Allocating every free block now can never hand `a` out.
    assert a not in pool.get_new_blocks(2)


def test_shared_block_stays_in_use_until_last_reference_goes() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1
    assert pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2


def test_freeing_a_free_block_is_a_bug() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="not in use"):
        pool.free_blocks([a])
    assert a.ref_cnt == 0


def test_one_hash_one_entry() -> None:
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_full_block(a, H1)
    pool.cache_full_block(b, H1)
    assert pool.get_cached_block(H1) is a
    assert b.block_hash is None
    assert pool.num_cached_blocks == 1
    pool.cache_full_block(a, H1)  # registering again is harmless
    with pytest.raises(RuntimeError, match="another hash"):
        pool.cache_full_block(a, H2)


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, H1)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(H1) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(H1) is None
    assert a.block_hash is None
    assert pool.num_cached_blocks == 0


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, H1)
    assert a.block_hash is None
    assert pool.get_cached_block(H1) is None


def test_check_consistency_catches_corruption() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.check_consistency()
    a.ref_cnt = 0  # in use per the free queue, unreferenced per the count
    with pytest.raises(RuntimeError, match="not in the free queue"):
        pool.check_consistency()


def test_blocks_compare_by_identity() -> None:
    assert KVBlock(0) != KVBlock(0)
    assert len({KVBlock(0), KVBlock(0)}) == 2


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / touch / free / cache against a model of the free queue's order."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(6)
        self.model_free: list[int] = list(range(6))  # eviction order
        self.model_cache: dict[bytes, int] = {}
        self.refs: list[KVBlock] = []  # one entry per reference held

    @rule(n=st.integers(0, 7))
    def allocate(self, n: int) -> None:
        if n > len(self.model_free):
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(n)
            return
        got = self.pool.get_new_blocks(n)
        expect, self.model_free = self.model_free[:n], self.model_free[n:]
        assert [b.block_id for b in got] == expect
        self.model_cache = {h: i for h, i in self.model_cache.items() if i not in expect}
        self.refs.extend(got)

    @rule(h=st.sampled_from([H1, H2, H3]))
    def touch_cached(self, h: bytes) -> None:
        block = self.pool.get_cached_block(h)
        assert (block.block_id if block else None) == self.model_cache.get(h)
        if block is not None:
            self.pool.touch([block])
            if block.block_id in self.model_free:
                self.model_free.remove(block.block_id)
            self.refs.append(block)

    @precondition(lambda self: self.refs)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        block = self.refs.pop(i % len(self.refs))
        self.pool.free_blocks([block])
        if block not in self.refs:
            self.model_free.append(block.block_id)

    @precondition(lambda self: self.refs)
    @rule(i=st.integers(0, 100), h=st.sampled_from([H1, H2, H3]))
    def cache(self, i: int, h: bytes) -> None:
        block = self.refs[i % len(self.refs)]
        if block.block_hash is not None and block.block_hash != h:
            with pytest.raises(RuntimeError):
                self.pool.cache_full_block(block, h)
            return
        self.pool.cache_full_block(block, h)
        self.model_cache.setdefault(h, block.block_id)

    @rule()
    def reset(self) -> None:
        idle = not self.refs
        assert self.pool.reset_prefix_cache() is idle
        if idle:
            self.model_cache.clear()

    @invariant()
    def matches_model(self) -> None:
        pool = self.pool
        pool.check_consistency()
        assert pool.free_block_ids() == self.model_free
        for block in pool.blocks:
            assert block.ref_cnt == sum(1 for r in self.refs if r is block) >= 0
        referenced = {b.block_id for b in self.refs}
        assert pool.num_free_blocks + len(referenced) == pool.num_blocks
        for h in (H1, H2, H3):
            block = pool.get_cached_block(h)
            assert (block.block_id if block else None) == self.model_cache.get(h)
            assert block is None or block.block_hash == h


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
