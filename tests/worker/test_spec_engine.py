"""Speculative decoding through the engine: proposals never change what a user gets.

Greedy outputs equal those without speculation token for token (n-gram and draft-model
proposals, k = 1..6, under preemption and with prefix caching, logprobs and penalties
included); sampled outputs keep the target's per-position distribution (chi-square against
the engine without speculation); the automatic switch turns speculation off under load and
on again after.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_llama import TINY, tiny_model

from hotpool.worker.engine.base import EngineRequest, RequestOutput
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.engine.spec.draft import DraftModelProposer
from hotpool.worker.engine.spec.proposer import ProposalInput, Proposer
from hotpool.worker.models.attention import PagedKVCache
from hotpool.worker.models.loader import load_model
from hotpool.worker.protocol import ChatMessage, SamplingParams, SpeculativeConfig
from hotpool.worker.tokenizer import TextTokenizer

CPU = torch.device("cpu")
BLOCK_BYTES = PagedKVCache.bytes_per_block(2, 16, 2, 16, torch.float32)  # tiny model, fp32
# Prompts that repeat themselves, as grounded tasks do, so n-gram proposals get accepted.
LOOPY = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [11], [20, 21, 22, 23, 24, 25, 26] * 4, [3] * 17]


def _run(
    engine: LLMEngine, requests: Sequence[EngineRequest], stagger: int = 0
) -> dict[str, list[RequestOutput]]:
    """Run to completion; request ``i`` joins before step ``i * stagger``."""
    outs: dict[str, list[RequestOutput]] = {}
    pending = list(requests)
    step = 0
    while pending or engine.has_unfinished():
        while pending and step >= (len(requests) - len(pending)) * stagger:
            engine.add_request(pending.pop(0))
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        step += 1
        assert step < 20_000
    return outs


def _tokens(outs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: [t for o in os_ for t in o.new_token_ids] for rid, os_ in outs.items()}


def _reqs(prompts: Sequence[Sequence[int]], **params: object) -> list[EngineRequest]:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 24)
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    return [EngineRequest(f"r{i}", tuple(p), sp, frozenset()) for i, p in enumerate(prompts)]


def _tiny(blocks: int = 256, spec: SpeculativeConfig | None = None, **kw: object) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=blocks * BLOCK_BYTES, speculative=spec, **kw)  # type: ignore[arg-type]
    return LLMEngine(tiny_model(), CPU, config)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_ngram_greedy_equals_plain_decoding(k: int) -> None:
    plain = _tokens(_run(_tiny(), _reqs(LOOPY), stagger=2))
    engine = _tiny(spec=SpeculativeConfig(num_tokens=k, max_batch=0))
    got = _tokens(_run(engine, _reqs(LOOPY), stagger=2))
    assert got == plain
    stats = engine.stats()
    assert stats.spec_proposed > 0 and stats.spec_accepted > 0  # it did speculate
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_greedy_equal_under_preemption_and_prefix_hits() -> None:
    # 12 blocks of 16 tokens for 4 requests of ~30 + 40 tokens: they preempt each other;
    # the repeated prompt gets prefix-cache hits.
    prompts = [*LOOPY, LOOPY[0]]
    plain_engine = _tiny(blocks=12, max_num_batched_tokens=32)
    plain = _tokens(_run(plain_engine, _reqs(prompts, max_tokens=40)))
    engine = _tiny(blocks=12, max_num_batched_tokens=32, spec=SpeculativeConfig(max_batch=0))
    got = _tokens(_run(engine, _reqs(prompts, max_tokens=40)))
    assert got == plain
    s = engine.stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0 and s.spec_accepted > 0
    engine.kv_manager.check_consistency()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_logprobs_penalties_and_stops_are_those_of_plain_decoding() -> None:
    params = dict(logprobs=3, repetition_penalty=1.3, max_tokens=20, stop_token_ids=[13])
    plain = _run(_tiny(), _reqs(LOOPY, **params))
    engine = _tiny(spec=SpeculativeConfig(num_tokens=5, max_batch=0))
    got = _run(engine, _reqs(LOOPY, **params))
    assert _tokens(got) == _tokens(plain)
    assert engine.stats().spec_proposed > 0
    for rid, outs in plain.items():
        want = [lp for o in outs for lp in o.logprobs]
        have = [lp for o in got[rid] for lp in o.logprobs]
        assert [t.token_id for t in have] == [t.token_id for t in want]
        for a, b in zip(have, want, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert got[rid][-1].finish_reason == outs[-1].finish_reason


def test_max_tokens_and_context_end_are_exact() -> None:
    # Proposals never carry a request past max_tokens or the model's context.
    engine = _tiny(spec=SpeculativeConfig(num_tokens=6, max_batch=0), max_model_len=40)
    got = _run(engine, _reqs(LOOPY, max_tokens=None))
    for rid, outs in got.items():
        n = len(LOOPY[int(rid[1:])])
        assert sum(len(o.new_token_ids) for o in outs) == 40 - n
        assert outs[-1].finish_reason == "length"
    got = _run(engine, _reqs(LOOPY, max_tokens=7))
    assert all(sum(len(o.new_token_ids) for o in v) == 7 for v in got.values())


class _RandomProposer(Proposer):
    """Random guesses, always k of them: every step verifies proposals, mostly rejected."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab

    def propose(self, requests: Sequence[ProposalInput], k: int) -> list[list[int]]:
        return [torch.randint(self.vocab, (k,), generator=self.gen).tolist() for _ in requests]

    def release(self, request_id: str) -> None:
        return None


def _small_vocab_model() -> tuple[object, int]:
    cfg = replace(TINY, vocab_size=12, eos_token_ids=(11,))
    return tiny_model(3, cfg), cfg.vocab_size


@pytest.mark.parametrize("proposer", ["ngram", "random"])
def test_sampled_distribution_is_the_targets(proposer: str) -> None:
    """Per-position token counts over many seeded draws, with and without speculation:
    a chi-square test of homogeneity must not reject at p = 0.001."""
    model, vocab = _small_vocab_model()
    n, steps = 1500, 5
    params = dict(temperature=0.9, top_k=6, top_p=0.9, max_tokens=steps, ignore_eos=True)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    def draws(spec: SpeculativeConfig | None, seed_base: int) -> list[Counter[int]]:
        config = EngineConfig(max_num_seqs=128, speculative=spec)
        prop = _RandomProposer(vocab, 7) if (spec and proposer == "random") else None
        engine = LLMEngine(model, CPU, config, proposer=prop)  # type: ignore[arg-type]
        sp = [SamplingParams(seed=seed_base + i, **params) for i in range(n)]  # type: ignore[arg-type]
        reqs = [EngineRequest(f"s{i}", tuple(prompt), sp[i], frozenset()) for i in range(n)]
        toks = _tokens(_run(engine, reqs))
        if spec is not None:
            assert engine.stats().spec_proposed > n  # most steps verified proposals
        counts = [Counter[int]() for _ in range(steps)]
        for seq in toks.values():
            assert len(seq) == steps
            for j, t in enumerate(seq):
                counts[j][t] += 1
        return counts

    plain = draws(None, 0)
    spec = draws(SpeculativeConfig(num_tokens=3, max_batch=0), 10**6)
    for j in range(1, steps):  # position 0 comes from the prefill: never speculated
        tokens = sorted(set(plain[j]) | set(spec[j]))
        table = [[plain[j][t] for t in tokens], [spec[j][t] for t in tokens]]
        p = _homogeneity_pvalue(table)
        assert p > 1e-3, f"position {j}: p = {p:.2e}, {table}"


def _homogeneity_pvalue(table: list[list[int]]) -> float:
    """Pearson's chi-square test that the rows of a contingency table share one
    distribution (scipy's ``chi2_contingency`` without the correction): the statistic's
    upper tail under chi2 with (rows - 1) * (cols - 1) degrees of freedom."""
    obs = torch.tensor(table, dtype=torch.float64)
    expected = obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
    stat = float(((obs - expected) ** 2 / expected).sum())
    dof = (obs.shape[0] - 1) * (obs.shape[1] - 1)
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_homogeneity_test_rejects_different_distributions() -> None:
    # The test above must be able to fail: a 10% shift of mass at this size is caught.
    assert _homogeneity_pvalue([[500, 300, 200], [400, 400, 200]]) < 1e-3
    assert _homogeneity_pvalue([[500, 300, 200], [505, 295, 200]]) > 0.5


def test_automatic_switch_turns_off_under_load_and_on_after() -> None:
    engine = _tiny(spec=SpeculativeConfig(num_tokens=4, max_batch=2))
    # Six requests at once, then five of them end early: the last one runs alone.
    reqs = _reqs(LOOPY + LOOPY[:2], max_tokens=6)
    reqs[0] = replace(reqs[0], params=SamplingParams(temperature=0.0, max_tokens=60))
    for r in reqs:
        engine.add_request(r)
    seen: list[tuple[bool, int]] = []
    while engine.has_unfinished():
        engine.step()
        seen.append((engine.stats().spec_enabled, len(engine.scheduler.running)))
    assert any(not on and running > 2 for on, running in seen)  # off under load
    assert seen[-1][0]  # on again once load dropped
    assert engine.spec_switch is not None and engine.spec_switch.num_switches == 2


def test_draft_model_random_draft_keeps_the_targets_output() -> None:
    plain = _tokens(_run(_tiny(), _reqs(LOOPY)))
    draft = DraftModelProposer(tiny_model(seed=5), CPU, target_vocab_size=TINY.vocab_size)
    spec = SpeculativeConfig(method="draft", draft_snapshot="tiny", max_batch=0)
    engine = LLMEngine(tiny_model(), CPU, EngineConfig(speculative=spec), proposer=draft)
    assert _tokens(_run(engine, _reqs(LOOPY))) == plain
    assert engine.stats().spec_proposed > 0


def test_draft_model_vocabulary_must_fit_the_target() -> None:
    big = replace(TINY, vocab_size=200)
    with pytest.raises(ValueError, match="vocabulary"):
        DraftModelProposer(tiny_model(cfg=big), CPU, target_vocab_size=TINY.vocab_size)


@pytest.mark.slow
def test_smollm2_drafting_for_itself_accepts_everything(smollm2_snapshot_fp32: Path) -> None:
    """SmolLM2 greedy with n-gram and with itself as the draft: the same tokens as without
    speculation, and its own draft is accepted (nearly) always."""
    model = load_model(smollm2_snapshot_fp32, CPU, torch.float32)
    text = (
        "Rewrite this sentence in the past tense: The cat sits on the mat and watches the "
        "birds in the garden while the sun sets behind the hills."
    )
    prompt = TextTokenizer(smollm2_snapshot_fp32).encode_chat([ChatMessage("user", text)])
    reqs = _reqs([prompt], max_tokens=32)
    plain = _tokens(_run(LLMEngine(model, CPU), reqs))
    ngram = LLMEngine(model, CPU, EngineConfig(speculative=SpeculativeConfig(max_batch=0)))
    assert _tokens(_run(ngram, reqs)) == plain
    assert ngram.stats().spec_accepted > 0
    spec = SpeculativeConfig(method="draft", draft_snapshot="self", num_tokens=4, max_batch=0)
    draft = DraftModelProposer(model, CPU, target_vocab_size=model.config.vocab_size)
    engine = LLMEngine(model, CPU, EngineConfig(speculative=spec), proposer=draft)
    assert _tokens(_run(engine, reqs)) == plain
    s = engine.stats()
    assert s.spec_accepted >= 0.95 * s.spec_proposed > 0
