"""Property-based tests of the scheduler over the real KV cache manager (no model: a fake
runner samples random tokens). Whatever arrives, aborts or runs short of blocks, the
scheduler keeps its invariants and every request it was given eventually finishes, with full
attention, a sliding window, or layer groups mixing both (Gemma 3's hybrid cache), and with
speculative proposals whose rejected slots go back (block conservation)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hotpool.worker.engine.kv_cache_manager import KVCacheManager
from hotpool.worker.engine.request import Request, RequestStatus
from hotpool.worker.engine.scheduler import Scheduler, SchedulerConfig
from hotpool.worker.protocol import SamplingParams


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_request_finishes_and_invariants_hold(data: st.DataObject) -> None:
    block_size = data.draw(st.integers(1, 8), "block_size")
    num_blocks = data.draw(st.integers(2, 40), "num_blocks")
    # One group (full or sliding) or several: a full group and 1-3 sliding ones.
    window = st.none() | st.integers(1, 12)
    windows = data.draw(
        st.tuples(window) | st.integers(1, 12).flatmap(
            lambda w: st.integers(1, 3).map(lambda n: (None,) + (w,) * n)
        ),
        "windows",
    )  # fmt: skip
    kv = KVCacheManager(
        num_blocks,
        block_size,
        enable_caching=data.draw(st.booleans(), "caching"),
        windows=windows,
    )
    config = SchedulerConfig(
        max_num_batched_tokens=data.draw(st.integers(1, 64), "budget"),
        max_num_seqs=data.draw(st.integers(1, 8), "max_num_seqs"),
        max_model_len=10_000,
    )
    sched = Scheduler(config, kv)
    spec_k = data.draw(st.sampled_from([0, 0, 1, 3, 6]), "spec_k")  # speculation at 0 of 5
    rng = random.Random(data.draw(st.integers(0, 2**16), "seed"))
    capacity = kv.num_blocks * block_size // len(windows)
    pending: list[Request] = []
    for i in range(data.draw(st.integers(1, 12), "num_requests")):
        max_new = rng.randint(1, 8)
        n = rng.randint(1, max(1, min(30, capacity - max_new)))
        if kv.blocks_held_at_most(n + max_new, config.max_num_batched_tokens) > kv.num_blocks:
            continue  # the engine rejects these before the scheduler sees them
        prompt = tuple(rng.randint(0, 2) for _ in range(n))  # tiny vocab: prefixes repeat
        pending.append(
            Request(f"r{i}", prompt, SamplingParams(max_tokens=max_new), frozenset(), i, max_new)
        )
    aborted: set[str] = set()
    finished: dict[str, Request] = {}
    for _step in range(5_000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if sched.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(sched.requests))
            sched.abort(victim)
            aborted.add(victim)
        out = sched.schedule()
        _check(sched, kv, config, out)
        # The fake verifier accepts a random prefix of each request's proposals, then emits
        # one token of its own, as rejection sampling does.
        sampled = {
            s.request.request_id: [
                *s.spec_token_ids[: rng.randint(0, len(s.spec_token_ids))],
                rng.randint(0, 2),
            ]
            for s in out.scheduled
            if s.samples
        }
        by_id = {s.request.request_id: s.request for s in out.scheduled}
        for rid in sched.update_from_output(out, sampled):
            finished[rid] = by_id[rid]
        for req in sched.running:
            # Proposals for the next step, as the engine makes them: only for a decode.
            if spec_k and req.num_tokens - req.num_computed_tokens == 1:
                req.spec_token_ids = [rng.randint(0, 2) for _ in range(rng.randint(0, spec_k))]
        kv.check_consistency()
        if not pending and not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and not pending, "requests never finished"
    for rid, req in finished.items():
        assert rid not in aborted
        assert len(req.output_token_ids) == req.max_new_tokens and req.finish_reason == "length"
    assert kv.num_free_blocks == kv.num_blocks  # every block came back


def _check(sched: Scheduler, kv: KVCacheManager, config: SchedulerConfig, out: object) -> None:
    scheduled = out.scheduled  # type: ignore[attr-defined]
    assert sum(s.num_new_tokens for s in scheduled) <= config.max_num_batched_tokens
    assert len(sched.running) <= config.max_num_seqs
    assert len({s.request.request_id for s in scheduled}) == len(scheduled)
    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    assert not running & waiting
    assert [r.arrival for r in sched.running] == sorted(r.arrival for r in sched.running)
    for s in scheduled:
        req = s.request
        assert req.status is RequestStatus.RUNNING and s.num_new_tokens >= 1
        k = len(s.spec_token_ids)
        assert s.start + s.num_new_tokens - k <= req.num_tokens
        if k:  # proposals only ride a decode, and never past what the request may emit
            assert s.start == req.num_tokens - 1 and s.samples
            assert k <= req.spec_room(config.max_model_len)
        # Every group's blocks cover every token this step computes.
        assert len(s.group_block_ids) == kv.num_groups
        assert len({len(t) for t in s.group_block_ids}) == 1
        assert len(s.block_ids) * kv.block_size >= s.start + s.num_new_tokens
        ph = kv.pool.placeholder
        for window, table in zip(kv.windows, s.group_block_ids, strict=True):
            # Every key the step's queries read, and every slot it writes, is a real block.
            first_read = 0 if window is None else max(0, s.start - window + 1)
            read = {table[p // kv.block_size] for p in range(first_read, s.start + 1)}
            written = table[s.start // kv.block_size :]
            assert ph is None or ph.block_id not in read | set(written)
        # No block is in two groups' tables (each group's pages hold other layers).
        live = [b for t in s.group_block_ids for b in t if ph is None or b != ph.block_id]
        assert len(live) == len(set(live))
    for req in sched.waiting:
        assert req.num_computed_tokens == 0 and kv.get_block_ids(req.request_id) == []
