"""Sliding-window KV: blocks that leave every future query's window go back to the pool, and a
prefix hit needs only the blocks its first new token reads.

Block size 4 throughout; block 0 of a windowed pool is the placeholder, so the usable blocks
of a pool of N are 1..N-1.
"""

from __future__ import annotations

import pytest

from hotpool.worker.engine.kv_cache_manager import KVCacheManager

BS = 4
PH = 0  # the placeholder's block id


def _toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def _live(m: KVCacheManager, rid: str) -> list[int]:
    return [b for b in m.get_block_ids(rid) if b != PH]


def _expected_live(num_tokens: int, first_new: int, window: int) -> int:
    """Blocks spanning tokens[:num_tokens] less those wholly before first_new - window + 1."""
    return -(-num_tokens // BS) - max(0, first_new - window + 1) // BS


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_sliding_window_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(8, BS, sliding_window=bad)  # type: ignore[arg-type]


def test_a_window_reserves_one_block_that_is_never_usable() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager(1, BS, sliding_window=8)
    full = KVCacheManager(10, BS)
    assert full.pool.placeholder is None
    assert full.num_blocks == full.num_free_blocks == 10

    m = KVCacheManager(10, BS, sliding_window=8)
    assert m.pool.placeholder is not None and m.pool.placeholder.block_id == PH
    assert m.num_blocks == m.num_free_blocks == 9
    assert m.usage == 0.0
    assert m.allocate_slots("a", _toks(12), 0, 12) is not None
    assert m.get_block_ids("a") == [1, 2, 3]  # the placeholder is never handed out
    assert m.usage == pytest.approx(3 / 9)
    m.free("a")
    assert m.num_free_blocks == 9
    assert m.reset_prefix_cache() is True  # idle although the placeholder stays pinned
    m.check_consistency()


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_a_long_request_runs_in_a_pool_far_smaller_than_it(chunk: int) -> None:
    window = 8
    m = KVCacheManager(5, BS, sliding_window=window)  # 4 usable blocks = 16 tokens
    full = KVCacheManager(5, BS)
    tokens = _toks(100)
    computed = 0
    most = 0
    while computed < len(tokens):
        num_new = min(chunk, len(tokens) - computed)
        assert m.allocate_slots("a", tokens, computed, num_new) is not None, computed
        end = computed + num_new
        ids = m.get_block_ids("a")
        assert len(ids) == -(-end // BS)  # one entry per block the sequence spans
        live = _live(m, "a")
        assert len(live) == _expected_live(end, computed, window)
        assert ids == [PH] * (len(ids) - len(live)) + live  # released entries lead
        assert m.num_free_blocks == 4 - len(live)
        m.check_consistency()
        most = max(most, len(live))
        computed = end
    assert most == {1: 3, 3: 4, 8: 4}[chunk]
    m.free("a")
    assert m.num_free_blocks == 4
    # Under full attention the pool holds 20 tokens, not 100: that is what the window buys.
    assert full.allocate_slots("a", tokens, 0, 21) is None


def test_live_positions_keep_their_slots() -> None:
    window = 6
    m = KVCacheManager(6, BS, sliding_window=window)
    tokens = _toks(7)
    assert m.allocate_slots("a", tokens, 0, 7) is not None
    slots: dict[int, int] = {}
    for computed in range(7, 60):
        tokens.append(1000 + computed)
        assert m.allocate_slots("a", tokens, computed, 1) is not None
        table = m.get_block_ids("a")
        for pos in range(computed + 1):
            block = table[pos // BS]
            if pos > computed - window:  # the window of the query at `computed`
                assert block != PH, pos
                slot = block * BS + pos % BS
                assert slots.setdefault(pos, slot) == slot, pos
            elif pos < (computed - window + 1) // BS * BS:
                assert block == PH, pos


def test_released_blocks_go_to_the_next_request() -> None:
    m = KVCacheManager(5, BS, sliding_window=8)
    tokens = _toks(12)
    m.allocate_slots("a", tokens, 0, 12)
    assert m.get_block_ids("a") == [1, 2, 3]
    tokens.append(99)
    # The query at 12 reads keys 5..12: block 1 (tokens 0..3) leaves, block 4 joins.
    new = m.allocate_slots("a", tokens, 12, 1)
    assert new is not None and new.block_ids() == [4]
    assert m.get_block_ids("a") == [PH, 2, 3, 4]
    assert m.pool.free_block_ids() == [1]
    assert m.pool.blocks[1].block_hash is not None  # still a prefix hit until evicted
    m.allocate_slots("b", _toks(3, 500), 0, 3)
    assert m.get_block_ids("b") == [1]
    assert m.pool.num_evicted_total == 1
    m.check_consistency()


def _long_request_released_its_first_three_blocks(window: int) -> KVCacheManager:
    """Request "a" computed 25 tokens, then stepped at 25, which releases blocks 1..3 (tokens
    0..11: 25 - W + 1 lies in 12..15 for W in 11..14); an unrelated request then evicted them.
    """
    m = KVCacheManager(12, BS, sliding_window=window)
    tokens = _toks(32)
    m.allocate_slots("a", tokens, 0, 25)
    assert m.get_block_ids("a") == [1, 2, 3, 4, 5, 6, 7]
    m.allocate_slots("a", tokens, 25, 1)
    assert m.get_block_ids("a") == [PH, PH, PH, 4, 5, 6, 7]
    assert m.pool.free_block_ids() == [8, 9, 10, 11, 1, 2, 3]
    m.allocate_slots("u", _toks(28, 500), 0, 28)
    assert m.pool.num_evicted_total == 3
    m.free("u")
    return m


@pytest.mark.parametrize(
    ("window", "hit_ids"),
    [
        (11, [PH, PH, PH, 4, 5, 6]),  # the token at 24 reads 14..24: blocks 4..6
        (13, [PH, PH, PH, 4, 5, 6]),  # reads 12..24: still blocks 4..6
        (14, []),  # reads 11..24: token 11 was in the evicted block 3
    ],
)
def test_a_hit_needs_exactly_the_blocks_its_first_new_token_reads(
    window: int, hit_ids: list[int]
) -> None:
    m = _long_request_released_its_first_three_blocks(window)
    query = [*_toks(24), 999]
    hits, n = m.get_computed_blocks("b", query)
    assert hits.block_ids() == hit_ids
    assert n == len(hit_ids) * BS
    assert m.prefix_cache_hits == n
    new = m.allocate_slots("b", query, n, len(query) - n, hits)
    assert new is not None
    assert m.get_block_ids("b") == [*hit_ids, *new.block_ids()]
    # Real hit blocks are shared with "a", which still holds them; placeholders are untouched.
    shared = [i for i in hit_ids if i != PH]
    assert [m.pool.blocks[i].ref_cnt for i in shared] == [2] * len(shared)
    assert m.pool.blocks[PH].ref_cnt == 1
    m.check_consistency()
    for rid in ("a", "b"):
        m.free(rid)
    assert m.num_free_blocks == m.num_blocks == 11
    m.check_consistency()


def test_a_hit_shorter_than_the_window_needs_every_block_from_the_start() -> None:
    m = KVCacheManager(10, BS, sliding_window=16)  # the token at 12 reads keys from 0
    m.allocate_slots("a", _toks(12), 0, 12)
    m.free("a")
    assert m.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    hits, n = m.get_computed_blocks("b", _toks(13))
    assert (hits.block_ids(), n) == ([1, 2, 3], 12)
    m.allocate_slots("u", _toks(28, 500), 0, 28)  # evicts block 3 (tokens 8..11)
    hits, n = m.get_computed_blocks("c", _toks(13))
    assert (hits.block_ids(), n) == ([1, 2], 8)


def test_a_hit_always_leaves_one_token_to_compute() -> None:
    m = KVCacheManager(10, BS, sliding_window=8)
    m.allocate_slots("a", _toks(20), 0, 20)
    hits, n = m.get_computed_blocks("b", _toks(16))
    assert (hits.block_ids(), n) == ([PH, 2, 3], 12)  # not 16: the last token is recomputed
    hits, n = m.get_computed_blocks("c", _toks(17))
    assert (hits.block_ids(), n) == ([PH, PH, 3, 4], 16)
    hits, n = m.get_computed_blocks("d", _toks(4))
    assert (len(hits), n) == (0, 0)


def test_a_window_of_one_still_needs_a_cached_block() -> None:
    m = KVCacheManager(5, BS, sliding_window=1)
    hits, n = m.get_computed_blocks("x", _toks(9))
    assert (len(hits), n) == (0, 0)  # an empty cache is no hit, though nothing would be read
    m.allocate_slots("a", _toks(9), 0, 9)
    hits, n = m.get_computed_blocks("b", _toks(9))
    assert (hits.block_ids(), n) == ([PH, 2], 8)
    new = m.allocate_slots("b", _toks(9), n, 1, hits)
    # Its first new token reads only itself: even the hit's last block is left untouched.
    assert new is not None and m.get_block_ids("b") == [PH, PH, *new.block_ids()]
    assert m.pool.blocks[2].ref_cnt == 1
    m.check_consistency()


def test_preempted_request_is_readmitted_on_its_own_window_blocks() -> None:
    m = KVCacheManager(5, BS, sliding_window=8)
    tokens = _toks(6)
    m.allocate_slots("a", tokens, 0, 6)
    for computed in range(6, 30):
        tokens.append(100 + computed)
        assert m.allocate_slots("a", tokens, computed, 1) is not None
    table = m.get_block_ids("a")
    # 30 tokens in 8 blocks; the last step, at 29, reads from 22, so blocks 0..4 are released.
    assert table[:5] == [PH] * 5 and len(table) == 8
    m.free("a")  # preempted
    assert m.num_free_blocks == 4 and m.pool.blocks[PH].ref_cnt == 1
    m.check_consistency()

    hits, n = m.get_computed_blocks("a", tokens)
    assert n == 28  # the token at 28 reads 21..28: blocks 5 and 6 of the table, still cached
    assert hits.block_ids() == [PH] * 5 + table[5:7]
    assert m.allocate_slots("a", tokens, n, len(tokens) - n, hits) is not None
    assert m.get_block_ids("a")[:7] == [PH] * 5 + table[5:7]
    m.check_consistency()


def test_releasing_a_shared_block_only_drops_this_requests_reference() -> None:
    m = KVCacheManager(5, BS, sliding_window=8)
    a = _toks(12)
    m.allocate_slots("a", a, 0, 12)
    b = [*_toks(4), 77]
    hits, n = m.get_computed_blocks("b", b)
    assert (hits.block_ids(), n) == ([1], 4)
    m.allocate_slots("b", b, n, 1, hits)
    assert m.get_block_ids("b") == [1, 4] and m.num_free_blocks == 0

    a.append(99)
    before = ([x.ref_cnt for x in m.pool.blocks], m.get_block_ids("a"))
    # Leaving a's window does not free block 1 (b holds it), so there is no block for 12.
    assert m.allocate_slots("a", a, 12, 1) is None
    assert ([x.ref_cnt for x in m.pool.blocks], m.get_block_ids("a")) == before

    m.free("b")
    new = m.allocate_slots("a", a, 12, 1)
    assert new is not None and new.block_ids() == [4]
    assert m.get_block_ids("a") == [PH, 2, 3, 4]
    assert m.pool.free_block_ids() == [1]
    m.check_consistency()


def test_the_placeholder_is_never_freed_touched_or_cached() -> None:
    m = KVCacheManager(4, BS, sliding_window=4)
    ph = m.pool.placeholder
    assert ph is not None
    for misuse in (m.pool.free_blocks, m.pool.touch):
        with pytest.raises(RuntimeError, match="placeholder"):
            misuse([ph])
    with pytest.raises(RuntimeError, match="placeholder"):
        m.pool.cache_full_block(ph, b"h" * 16)
    with pytest.raises(RuntimeError, match="fresh pool"):
        m.pool.reserve_placeholder()
    ph.ref_cnt = 2
    with pytest.raises(RuntimeError, match="placeholder"):
        m.check_consistency()
