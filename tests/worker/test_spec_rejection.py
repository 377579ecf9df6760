"""Verifying proposals keeps the target's distribution: greedy rows emit exactly the
target's argmax chain, sampled rows emit tokens distributed as the target alone would draw
them (chi-square, p > 0.001), whatever was proposed."""

from __future__ import annotations

import bisect
import random
import zlib
from dataclasses import replace

import pytest
import torch

from hotpool.kernels.sampling import NonFiniteLogitsError, SamplingRow, sample
from hotpool.kernels.sampling_random import row_generators
from hotpool.kernels.sampling_reference import reference_probs
from hotpool.worker.engine.spec.rejection import accept, verify, verify_batch

P_MIN = 1e-3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs``: a copy of
    tests/kernels/test_sampling_distribution.py's (that folder is not importable from
    here). Bins expected fewer than 5 times are pooled; no count may fall outside the
    support."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens the filters removed: {counts[~support]}"
    expected = probs[support].double() * counts.sum()
    observed = counts[support].double()
    low = expected < 5
    if low.any():
        pooled_e, pooled_o = expected[low].sum(), observed[low].sum()
        expected, observed = expected[~low], observed[~low]
        if pooled_e < 5 and expected.numel():
            i = expected.argmin()
            expected[i] += pooled_e
            observed[i] += pooled_o
        else:
            expected = torch.cat([expected, pooled_e[None]])
            observed = torch.cat([observed, pooled_o[None]])
    df = expected.numel() - 1
    if df == 0:
        return 1.0
    stat = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))


def random_logits(*shape: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- greedy -------------------------------------------------------------------------------


@pytest.mark.parametrize("wrong_at", [0, 1, 3, 4])
def test_greedy_accepts_the_argmax_chain_then_emits_the_argmax(wrong_at: int) -> None:
    k = 4
    logits = random_logits(k + 1, 50, seed=wrong_at)
    best = logits.argmax(dim=1).tolist()
    drafts = best[:k]
    if wrong_at < k:
        drafts[wrong_at] = (best[wrong_at] + 1) % 50
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    out = verify(logits, drafts, None, SamplingRow(temperature=0.0), gen)
    assert out == best[: wrong_at + 1]
    assert torch.equal(gen.get_state(), state)  # greedy draws nothing


def test_greedy_ignores_a_draft_distribution_and_top_k_1_is_greedy() -> None:
    logits = random_logits(3, 20, seed=7)
    best = logits.argmax(dim=1).tolist()
    q = torch.full((2, 20), 1 / 20)
    for row in (SamplingRow(temperature=0.0), SamplingRow(temperature=1.5, top_k=1)):
        assert verify(logits, best[:2], q, row) == best


def test_greedy_with_penalties_is_the_samplers_chain_with_drafts_as_output() -> None:
    """Position 1's penalties count draft 0 as output: a draft that tops position 1 by a
    small margin loses it to the presence penalty, as it would without speculation."""
    logits = torch.zeros(3, 8)
    logits[0, 5] = 3.0
    logits[1, 5], logits[1, 2] = 3.0, 2.5  # 5 wins unpenalized, 2 once 5 was emitted
    logits[2, 6] = 1.0
    row = SamplingRow(temperature=0.0, presence_penalty=1.0, output_token_ids=(7,))
    assert verify(logits, [5, 5], None, row) == [5, 2]
    assert verify(logits, [5, 2], None, row) == [5, 2, 6]
    # Against the sampler itself, on random logits with every penalty.
    logits = random_logits(5, 30, seed=3, scale=0.5)
    row = SamplingRow(
        temperature=0.0,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        prompt_token_ids=(1, 2, 3),
        output_token_ids=(4, 4),
    )
    out, chain = [], list(row.output_token_ids)
    for j in range(5):
        at = replace(row, output_token_ids=tuple(chain))
        t = int(sample(logits[j : j + 1], [at], backend="torch").token_ids[0])
        out.append(t)
        chain.append(t)
    assert verify(logits, out[:4], None, row) == out


def test_greedy_respects_the_grammar_mask_at_each_position() -> None:
    logits = random_logits(3, 10, seed=5)
    allowed = torch.zeros(3, 10, dtype=torch.bool)
    allowed[:, 7:] = True
    best = (logits[:, 7:].argmax(dim=1) + 7).tolist()
    assert verify(logits, best[:2], None, SamplingRow(temperature=0.0), allowed=allowed) == best


# --- the output's shape and randomness ----------------------------------------------------


def test_emits_between_one_and_k_plus_one_tokens_starting_with_accepted_drafts() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = set()
    for trial in range(200):
        k = trial % 5
        logits = random_logits(k + 1, 12, seed=trial, scale=3.0)
        drafts = logits[:k].argmax(dim=1).tolist()  # likely, so some are accepted
        if trial % 3 == 0 and k:
            drafts[-1] = 0
        q = None if trial % 2 else torch.softmax(random_logits(k, 12, seed=-trial), dim=1)
        out = verify(logits, drafts, q, SamplingRow(temperature=1.0, top_k=6), gen)
        assert 1 <= len(out) <= k + 1
        assert out[:-1] == drafts[: len(out) - 1]
        lengths.add((k, len(out)))
    assert {(4, 1), (4, 5), (0, 1)} <= lengths


def test_a_seeded_generator_reproduces_the_tokens_and_draws_k_plus_one_uniforms() -> None:
    logits = random_logits(5, 16, seed=11)
    q = torch.softmax(random_logits(4, 16, seed=12), dim=1)
    drafts = [3, 1, 4, 1]
    row = SamplingRow(temperature=0.9, top_p=0.95)

    def run(seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return [verify(logits, drafts, q if i % 2 else None, row, gen) for i in range(50)]

    assert run(5) == run(5)
    assert run(5) != run(6)
    gen = torch.Generator().manual_seed(9)
    verify(logits, drafts, q, row, gen)
    twin = torch.Generator().manual_seed(9)
    torch.rand(5, generator=twin, dtype=torch.float64)
    assert torch.equal(gen.get_state(), twin.get_state())


def test_verify_is_accept_on_the_samplers_reference_distributions() -> None:
    """The processing is the sampler's: each position's distribution is reference_probs of
    its logits, with the drafts before it counted as output and its own mask."""
    rows = [
        SamplingRow(temperature=0.7, top_k=5),
        SamplingRow(top_p=0.8, min_p=0.1),
        SamplingRow(
            temperature=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            repetition_penalty=1.5,
            prompt_token_ids=(0, 1),
            output_token_ids=(2, 3, 3),
        ),
    ]
    for i, row in enumerate(rows * 4):
        k = 1 + i % 4
        logits = random_logits(k + 1, 16, seed=100 + i)
        drafts = torch.randint(16, (k,), generator=torch.Generator().manual_seed(i)).tolist()
        allowed = torch.rand(k + 1, 16, generator=torch.Generator().manual_seed(-i)) < 0.7
        allowed[:, 0] = True
        q = torch.softmax(random_logits(k, 16, seed=200 + i), dim=1) if i % 2 else None
        probs = torch.stack(
            [
                reference_probs(
                    logits[j],
                    replace(row, output_token_ids=(*row.output_token_ids, *drafts[:j])),
                    allowed[j],
                )
                for j in range(k + 1)
            ]
        )
        got = verify(logits, drafts, q, row, torch.Generator().manual_seed(i), allowed)
        want = accept(probs, drafts, q, torch.Generator().manual_seed(i))
        assert got == want


def test_a_batch_gives_each_row_its_own_generator_by_the_samplers_rules() -> None:
    logits = random_logits(10, 16, seed=21)
    drafts = [[1, 2], [], [3, 4, 5, 6, 7]]
    rows = [
        SamplingRow(seed=42, offset=3),
        SamplingRow(temperature=0.0),
        SamplingRow(generator=torch.Generator().manual_seed(8), top_k=4),
    ]
    got = verify_batch(logits, drafts, None, rows)
    gens = row_generators([rows[0], replace(rows[2], generator=torch.Generator().manual_seed(8))])
    assert got == [
        verify(logits[0:3], drafts[0], None, rows[0], gens[0]),
        verify(logits[3:4], [], None, rows[1]),
        verify(logits[4:10], drafts[2], None, rows[2], gens[1]),
    ]
    # A seeded row's tokens do not depend on the rest of the batch.
    assert verify_batch(logits[:3], drafts[:1], None, rows[:1]) == got[:1]


def test_logits_without_a_distribution_are_refused_before_any_draw() -> None:
    logits = random_logits(4, 8, seed=1)
    logits[2, 3] = float("nan")
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    with pytest.raises(NonFiniteLogitsError) as err:
        verify(logits, [0, 1, 2], None, SamplingRow(), gen)
    assert err.value.rows == (2,)
    assert torch.equal(gen.get_state(), state)
    batch = torch.cat([random_logits(2, 8, seed=2), logits])
    with pytest.raises(NonFiniteLogitsError) as err:
        verify_batch(batch, [[1], [0, 1, 2]], None, [SamplingRow(), SamplingRow()])
    assert err.value.rows == (1,)  # the batch row, not the position
    masked = random_logits(2, 8, seed=3)
    allowed = torch.ones(2, 8, dtype=torch.bool)
    masked[1, :4] = float("-inf")
    allowed[1, 4:] = False
    with pytest.raises(NonFiniteLogitsError):
        verify(masked, [1], None, SamplingRow(), allowed=allowed)


def test_malformed_inputs_are_refused() -> None:
    logits = random_logits(3, 8, seed=1)
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify(logits, [1], None, SamplingRow())
    with pytest.raises(ValueError, match="draft tokens"):
        verify(logits, [1, 8], None, SamplingRow())
    with pytest.raises(ValueError, match="draft_probs"):
        verify(logits, [1, 2], torch.full((2, 7), 1 / 7), SamplingRow())
    with pytest.raises(ValueError, match="allowed"):
        verify(logits, [1, 2], None, SamplingRow(), allowed=torch.ones(3, 8))
    q = torch.full((2, 8), 1 / 7)
    q[0, 1] = 0.0
    with pytest.raises(ValueError, match="probability 0"):
        verify(logits, [1, 2], q, SamplingRow(temperature=1.0))
    with pytest.raises(ValueError, match="one entry per row"):
        verify_batch(logits, [[1]], None, [SamplingRow(), SamplingRow()])


# --- the distribution ---------------------------------------------------------------------
#
# A target "model" whose next-token logits at position t depend on t and on the token
# before it (a Markov chain), so a draft changes the logits after it exactly as it does in
# the engine. Each trial generates k + 2 tokens by speculative steps, as the engine would (a
# step that emits j tokens is followed by one from position j): the joint of the first two
# tokens must be the target's, p_0(a) * p_1(b | a), and so must the marginal at every
# position (the first step's bonus token is at k).

V = 6
START = 0  # the token before position 0
DRAWS = 6_000


def markov_logits(positions: int, seed: int) -> torch.Tensor:
    """``[positions, V, V]``: the logits at position t after token prev."""
    return random_logits(positions, V, V, seed=seed)


def marginals(probs_at: torch.Tensor, length: int) -> list[torch.Tensor]:
    """The target's distribution of the token at each position < length."""
    m = [probs_at[0, START]]
    for t in range(1, length):
        m.append(m[-1] @ probs_at[t])
    return m


class DraftPool:
    """Draft tokens for each (position, previous token): fixed ones (n-gram style), or
    draws from a distribution q."""

    def __init__(self, fixed: torch.Tensor | None, q: torch.Tensor | None, seed: int) -> None:
        self.fixed = None if fixed is None else fixed.tolist()
        self.q = q
        self.cdf = None if q is None else q.cumsum(dim=2).tolist()
        self.rng = random.Random(seed)

    def draft(self, t: int, prev: int) -> int:
        if self.cdf is None:
            return self.fixed[t][prev]
        cdf = self.cdf[t][prev]
        return bisect.bisect_right(cdf, self.rng.random() * cdf[-1])


def generate(
    k: int,
    length: int,
    probs_at: torch.Tensor,
    drafts: DraftPool,
    gen: torch.Generator,
    draws: int,
) -> torch.Tensor:
    """``[draws, length]`` tokens of speculative generations through ``accept``, with
    ``probs_at[t, prev]`` the target's processed distribution."""
    p_at = [list(position) for position in probs_at]  # row views, indexed in Python
    q_at = None if drafts.q is None else [list(position) for position in drafts.q]
    runs = []
    for _ in range(draws):
        out: list[int] = []
        while len(out) < length:
            s, ctx = len(out), out[-1] if out else START
            proposed, contexts = [], [ctx]
            for j in range(k):
                ctx = drafts.draft(s + j, ctx)
                proposed.append(ctx)
                contexts.append(ctx)
            p = torch.stack([p_at[s + j][c] for j, c in enumerate(contexts)])
            q = None
            if q_at is not None:
                q = torch.stack([q_at[s + j][c] for j, c in enumerate(contexts[:k])])
            out.extend(accept(p, proposed, q, gen))
        runs.append(out[:length])
    return torch.tensor(runs)


ROWS = {
    "T=1": SamplingRow(),
    "top_k=2": SamplingRow(top_k=2),
    "top_p=0.7,T=0.7": SamplingRow(temperature=0.7, top_p=0.7),
    "min_p=0.3,T=1.3": SamplingRow(temperature=1.3, min_p=0.3),
    "all filters": SamplingRow(temperature=0.9, top_k=4, top_p=0.9, min_p=0.05),
}
# (row, k, proposer): "fixed" proposes fixed tokens, the first of them the one the target
# likes least (filtered out wherever a filter cuts); "q" draws drafts from a random q of
# full support; "sparse q" from one that never proposes some tokens; "q=p" from the target
# itself (always accepted).
CASES = [
    ("T=1", 3, "fixed"),
    ("top_k=2", 3, "fixed"),
    ("top_p=0.7,T=0.7", 2, "fixed"),
    ("min_p=0.3,T=1.3", 4, "fixed"),
    ("all filters", 1, "fixed"),
    ("T=1", 3, "q"),
    ("top_k=2", 2, "q"),
    ("all filters", 3, "sparse q"),
    ("top_p=0.7,T=0.7", 3, "q=p"),
]


@pytest.mark.parametrize(
    ("name", "k", "proposer"), CASES, ids=[f"{c[0]}-k{c[1]}-{c[2]}" for c in CASES]
)
def test_speculation_keeps_the_targets_distribution(name: str, k: int, proposer: str) -> None:
    row = ROWS[name]
    seed = zlib.crc32(f"{name} {k} {proposer}".encode()) % 10_000
    length = k + 2
    logits = markov_logits(length + k, seed)
    probs_at = torch.stack(
        [torch.stack([reference_probs(x, row) for x in position]) for position in logits]
    )
    fixed = q = None
    if proposer == "fixed":
        fixed = torch.randint(V, (length + k, V), generator=torch.Generator().manual_seed(seed))
        fixed[0, START] = int(logits[0, START].argmin())  # p = 0 under every cutting filter
        fixed[1::2] = logits[1::2].argmax(dim=2)  # often accepted
        if name != "T=1":
            assert probs_at[0, START, fixed[0, START]] == 0.0
    elif proposer == "q=p":
        q = probs_at
    else:
        q = torch.softmax(random_logits(length + k, V, V, seed=seed + 1), dim=2).double()
        if proposer == "sparse q":
            q[..., :2] = 0.0  # tokens 0 and 1 only ever come from the residual or the bonus
            q /= q.sum(dim=2, keepdim=True)
    gen = torch.Generator().manual_seed(seed)
    runs = generate(k, length, probs_at, DraftPool(fixed, q, seed), gen, DRAWS)
    joint = torch.bincount(runs[:, 0] * V + runs[:, 1], minlength=V * V)
    want = probs_at[0, START][:, None] * probs_at[1]  # p_0(a) * p_1(b | a)
    assert chi_square_p(joint, want.flatten()) > P_MIN
    for t, m in enumerate(marginals(probs_at, length)):
        p = chi_square_p(torch.bincount(runs[:, t], minlength=V), m)
        assert p > P_MIN, f"position {t}: chi-square p = {p:.2e}"


def test_speculation_keeps_the_targets_distribution_through_verify_with_penalties() -> None:
    """End to end through ``verify`` (the sampler's processing, each position penalized
    for the drafts before it), fewer draws: a penalized, top-p row, n-gram style drafts."""
    k, draws = 2, 2_000
    logits = markov_logits(2 + k, seed=77)
    row = SamplingRow(top_p=0.9, presence_penalty=0.8, frequency_penalty=0.4, output_token_ids=(3,))
    fixed = torch.randint(V, (2 + k, V), generator=torch.Generator().manual_seed(77)).tolist()
    fixed[1] = logits[1].argmax(dim=1).tolist()
    gen = torch.Generator().manual_seed(77)
    counts = torch.zeros(V, V, dtype=torch.long)
    for _ in range(draws):
        out: list[int] = []
        while len(out) < 2:
            s, ctx = len(out), out[-1] if out else START
            proposed, contexts = [], [ctx]
            for j in range(k):
                ctx = fixed[s + j][ctx]
                proposed.append(ctx)
                contexts.append(ctx)
            rows = logits[torch.arange(s, s + k + 1), torch.tensor(contexts)]
            at = replace(row, output_token_ids=(*row.output_token_ids, *out))
            out.extend(verify(rows, proposed, None, at, gen))
        counts[out[0], out[1]] += 1
    p0 = reference_probs(logits[0, START], row)
    want = torch.stack(
        [
            p0[a] * reference_probs(logits[1, a], replace(row, output_token_ids=(3, a)))
            for a in range(V)
        ]
    )
    assert chi_square_p(counts.flatten(), want.flatten()) > P_MIN
