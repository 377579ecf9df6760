"""The hybrid KV cache: a model mixing full and sliding layers keeps one block table per layer
group, drawn from one pool, and frees the sliding groups' blocks behind the window."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotpool.worker.engine.kv_cache_manager import KVCacheManager
from hotpool.worker.engine.kv_groups import kv_cache_groups

BS = 4
W = 8
WINDOWS = (None, W, W)  # one full group and two sliding ones


def _gemma_windows(num_layers: int, window: int = 512) -> list[int | None]:
    """Gemma 3's pattern: five sliding layers, then a global one."""
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_gemma3_270m_splits_into_one_full_and_five_sliding_groups_of_three() -> None:
    groups = kv_cache_groups(_gemma_windows(18))
    assert groups.windows == (None, 512, 512, 512, 512, 512)
    assert groups.layers[0] == (5, 11, 17)
    assert groups.layers[1:] == ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert groups.slots == 3
    # Every layer lands in exactly one (group, slot), and no two layers of a group share a slot.
    pairs = list(zip(groups.layer_group, groups.layer_slot, strict=True))
    assert len(set(pairs)) == 18 and max(groups.layer_slot) == 2


def test_a_kind_that_does_not_divide_evenly_gets_a_short_last_group() -> None:
    groups = kv_cache_groups(_gemma_windows(26))  # Gemma 3 1B: 4 global, 22 sliding
    assert groups.slots == 4
    assert [len(g) for g in groups.layers] == [4, 4, 4, 4, 4, 4, 2]


@pytest.mark.parametrize("windows", [[None] * 5, [16] * 5])
def test_one_kind_of_layer_is_one_group_in_the_plain_layout(windows: list[int | None]) -> None:
    groups = kv_cache_groups(windows)
    assert groups.windows == (windows[0],)
    assert groups.layer_slot == (0, 1, 2, 3, 4) and groups.layer_group == (0,) * 5


@pytest.mark.parametrize("bad", [[], [0, None], [True, None]])
def test_bad_layer_windows_are_refused(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        kv_cache_groups(bad)  # type: ignore[arg-type]


def _grow(m: KVCacheManager, rid: str, tokens: list[int], chunk: int) -> int:
    """Prefill ``tokens`` ``chunk`` at a time; return the most blocks held at once."""
    most, done = 0, 0
    free_at_start = m.num_free_blocks
    while done < len(tokens):
        step = min(chunk, len(tokens) - done)
        assert m.allocate_slots(rid, tokens, done, step) is not None
        done += step
        most = max(most, free_at_start - m.num_free_blocks)
        m.check_consistency()
    return most


def test_sliding_groups_free_blocks_behind_the_window_while_the_full_group_keeps_all() -> None:
    m = KVCacheManager(64, BS, windows=WINDOWS)
    tokens = list(range(60))  # 15 blocks
    most = _grow(m, "a", tokens, chunk=4)
    full, *sliding = m.get_group_block_ids("a")
    ph = m.pool.placeholder
    assert ph is not None
    assert len(full) == 15 and ph.block_id not in full
    for table in sliding:
        assert len(table) == 15  # every group spans the same positions
        live = [b for b in table if b != ph.block_id]
        assert len(live) <= -(-(W - 1 + 4) // BS) + 1  # the window and the chunk
        assert table[-len(live) :] == tuple(live)  # released positions lead
    # One table for all three groups would have held 45 blocks.
    assert most <= 15 + 2 * 4
    held = [b for t in m.get_group_block_ids("a") for b in t if b != ph.block_id]
    assert len(held) == len(set(held)) == m.num_blocks - m.num_free_blocks
    m.free("a")
    assert m.num_free_blocks == m.num_blocks
    m.check_consistency()


def test_a_prefix_hit_holds_in_every_group() -> None:
    m = KVCacheManager(64, BS, windows=WINDOWS)
    prompt = list(range(24))  # 6 blocks
    _grow(m, "a", prompt, chunk=24)
    m.free("a")
    hits, n = m.get_computed_blocks("b", [*prompt, 99])
    assert n == 24 and len(hits.groups) == 3
    ph = m.pool.placeholder
    full, *sliding = hits.groups
    assert ph not in full and len(full) == 6
    for group in sliding:
        # The first new token (position 24) reads keys 17..24: blocks 4 and 5 only.
        assert group[:4] == (ph,) * 4 and ph not in group[4:]
    assert len({b.block_id for g in hits.groups for b in g if b is not ph}) == 6 + 2 + 2
    assert m.allocate_slots("b", [*prompt, 99], n, 1, hits) is not None
    m.check_consistency()


def test_a_block_evicted_from_one_group_shortens_the_hit_for_all() -> None:
    m = KVCacheManager(64, BS, windows=WINDOWS)
    prompt = list(range(24))
    _grow(m, "a", prompt, chunk=24)
    m.free("a")
    # Evict the last block of the second sliding group only: its hit of 6 blocks is gone, and
    # a shorter hit must then hold in every group, the sliding ones re-asked for it.
    victim = m.get_computed_blocks("x", [*prompt, 1])[0].groups[2][5]
    m.pool._evict(victim)
    hits, n = m.get_computed_blocks("b", [*prompt, 99])
    assert n == 20 and all(len(g) == 5 for g in hits.groups)
    ph = m.pool.placeholder
    for group in hits.groups[1:]:
        # Position 20 reads keys 13..20: blocks 3 and 4.
        assert group[:3] == (ph,) * 3 and ph not in group[3:]
    m.free("x")
    m.check_consistency()


def test_a_short_pool_changes_nothing_in_any_group() -> None:
    m = KVCacheManager(8, BS, windows=WINDOWS)  # 7 usable blocks
    assert m.allocate_slots("a", list(range(8)), 0, 8) is not None  # 2 blocks x 3 groups
    before = (m.num_free_blocks, m.get_group_block_ids("a"), [b.ref_cnt for b in m.pool.blocks])
    assert m.allocate_slots("a", list(range(12)), 8, 4) is None  # 3 more: one is free
    after = (m.num_free_blocks, m.get_group_block_ids("a"), [b.ref_cnt for b in m.pool.blocks])
    assert after == before
    m.check_consistency()


def test_blocks_held_at_most_counts_every_group() -> None:
    m = KVCacheManager(64, BS, windows=WINDOWS)
    # 100 tokens: the full group spans 25 blocks; each sliding group a window (8), a chunk (4)
    # and two partial blocks: 20 tokens = 5 blocks.
    assert m.blocks_held_at_most(100, 4) == 25 + 5 + 5
    assert KVCacheManager(64, BS).blocks_held_at_most(100, 4) == 25
    with pytest.raises(ValueError, match="not both"):
        KVCacheManager(8, BS, sliding_window=4, windows=(None, 4))


@pytest.mark.parametrize("windows", [(None,), (W,), WINDOWS])
def test_rejected_speculative_slots_go_back_and_the_prefix_cache_is_untouched(
    windows: tuple[int | None, ...],
) -> None:
    m = KVCacheManager(64, BS, windows=windows)
    tokens = list(range(10))  # known: 10 tokens; 6 more slots for proposals
    assert m.allocate_slots("a", tokens, 0, 10) is not None
    cached = m.pool.num_cached_blocks  # the 2 full blocks of known tokens, per group
    free = m.num_free_blocks
    assert m.allocate_slots("a", tokens, 10, 6) is not None  # 16 slots: a 4th block a group
    assert m.num_free_blocks == free - len(windows)
    assert m.pool.num_cached_blocks == cached  # proposals are never registered
    # Two of six accepted: 12 tokens known; the last block (slots 12..15) goes back.
    assert m.free_tail("a", 12) == len(windows)
    assert all(len(t) == 3 for t in m.get_group_block_ids("a"))
    assert m.num_free_blocks == free
    m.check_consistency()
    accepted = [*tokens, 70, 71]
    assert m.allocate_slots("a", accepted, 12, 1) is not None  # the next step goes on
    m.free("a")
    assert m.num_free_blocks == m.num_blocks
    m.check_consistency()


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_blocks_are_conserved_under_speculation(data: st.DataObject) -> None:
    """Requests decode with k proposals a step, keep a random number of them and free the
    slots of the rest; preempted when short. Every block comes back, and the bookkeeping
    holds after every step, for any mix of groups."""
    windows = data.draw(st.sampled_from([(None,), (W,), WINDOWS, (None, 3)]), "windows")
    m = KVCacheManager(data.draw(st.integers(8, 40), "blocks"), BS, windows=windows)
    rng = random.Random(data.draw(st.integers(0, 2**16), "seed"))
    known: dict[str, list[int]] = {f"r{i}": [rng.randint(0, 3) for _ in range(5)] for i in range(3)}
    computed = dict.fromkeys(known, 0)
    for _ in range(60):
        rid = rng.choice(sorted(known))
        tokens, k = known[rid], rng.randint(0, 6)
        if computed[rid] == 0:
            hits, n = m.get_computed_blocks(rid, tokens)
            if m.allocate_slots(rid, tokens, n, len(tokens) - n, hits) is None:
                m.free(rid)
                continue
            computed[rid] = len(tokens) - 1  # the last known token is computed with proposals
        # One decode step: the last known token and k proposals (not known tokens).
        if m.allocate_slots(rid, tokens, computed[rid], 1 + k) is None:
            m.free(rid)  # preempted: recomputed from scratch later
            computed[rid] = 0
            continue
        accepted = rng.randint(0, k)
        tokens.extend(rng.randint(0, 3) for _ in range(accepted + 1))  # + the bonus token
        computed[rid] += 1 + accepted
        m.free_tail(rid, computed[rid])
        m.check_consistency()
    for rid in known:
        m.free(rid)
    m.check_consistency()
    assert m.num_free_blocks == m.num_blocks
