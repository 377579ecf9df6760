"""The sampler: greedy rows, seeded rows, and the distribution top-k / top-p leave."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from hotpool.kernels.sampling import RowParams, sample

DRAWS = 4000


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def frequencies(logits: list[float], params: RowParams, draws: int = DRAWS) -> dict[int, float]:
    """How often each token comes out of ``draws`` samples of one row (in one batch)."""
    torch.manual_seed(1234)  # unseeded rows draw from the global generator: keep it fixed
    batch = torch.tensor([logits]).repeat(draws, 1)
    tokens = sample(batch, [params] * draws)
    counts = Counter(tokens.tolist())
    return {t: n / draws for t, n in sorted(counts.items())}


def test_temperature_zero_is_argmax_per_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    tokens = sample(logits, [RowParams(temperature=0.0)] * 5)
    assert tokens.dtype == torch.long
    assert tokens.shape == (5,)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_greedy_ignores_top_k_top_p_and_generator() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 4.9]])
    rows = [RowParams(temperature=0.0, top_k=2, top_p=0.1, generator=gen(1))] * 2
    assert sample(logits, rows).tolist() == [1, 0]


def test_top_k_1_is_argmax_even_when_hot() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 1000)
    rows = [RowParams(temperature=2.0, top_k=1, generator=gen(i)) for i in range(8)]
    assert sample(logits, rows).tolist() == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_argmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(8, 1000)
    rows = [RowParams(temperature=1.5, top_p=1e-6, generator=gen(i)) for i in range(8)]
    assert sample(logits, rows).tolist() == logits.argmax(dim=-1).tolist()


def test_mixed_batch_rows_keep_their_own_params() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 7.0]])
    rows = [
        RowParams(temperature=0.0),
        RowParams(temperature=1.0, top_k=1, generator=gen(0)),
        RowParams(temperature=0.7, top_p=0.01, generator=gen(0)),
    ]
    assert sample(logits, rows).tolist() == [2, 0, 3]


def test_half_precision_logits_are_accepted() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]], dtype=torch.bfloat16)
    assert sample(logits, [RowParams(temperature=0.0)]).tolist() == [1]


def test_same_seed_same_tokens() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, 50)

    def run(seed: int) -> list[int]:
        g = gen(seed)  # one generator per request, drawn from at every step
        return [int(sample(logits, [RowParams(generator=g)])[0]) for _ in range(40)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_seeded_rows_do_not_depend_on_their_batch_neighbours() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 64)
    alone = sample(logits[1:2], [RowParams(generator=gen(42))])
    rows = [RowParams(generator=gen(1)), RowParams(generator=gen(42)), RowParams()]
    together = sample(logits, rows)
    assert together[1] == alone[0]


def test_different_seeds_eventually_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: two seeds agreeing 20 times is ~1e-60
    firsts = {int(sample(logits, [RowParams(generator=gen(s))])[0]) for s in range(20)}
    assert len(firsts) > 1


def test_unfiltered_distribution_follows_softmax() -> None:
    freq = frequencies([math.log(0.5), math.log(0.3), math.log(0.2)], RowParams())
    assert set(freq) == {0, 1, 2}
    for token, p in enumerate([0.5, 0.3, 0.2]):
        assert freq[token] == pytest.approx(p, abs=0.03)


def test_temperature_sharpens_the_distribution() -> None:
    # p ∝ [0.5, 0.3, 0.2] ** 2 = [0.25, 0.09, 0.04] / 0.38
    freq = frequencies([math.log(0.5), math.log(0.3), math.log(0.2)], RowParams(temperature=0.5))
    for token, p in enumerate([0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]):
        assert freq.get(token, 0.0) == pytest.approx(p, abs=0.03)


@pytest.mark.parametrize(
    "params",
    [RowParams(top_p=0.6), RowParams(top_k=2), RowParams(top_k=2, top_p=0.9)],
    ids=["top_p=0.6", "top_k=2", "top_k=2,top_p=0.9"],
)
def test_filters_keep_the_head_and_renormalise(params: RowParams) -> None:
    # top_p=0.6: 0.5 alone is short of 0.6, so token 1 (which crosses it) stays in and
    # token 2 is cut. top_k=2 cuts the same token. Survivors: 0.5/0.8 and 0.3/0.8.
    freq = frequencies([math.log(0.5), math.log(0.3), math.log(0.2)], params)
    assert set(freq) == {0, 1}
    assert freq[0] == pytest.approx(0.625, abs=0.03)
    assert freq[1] == pytest.approx(0.375, abs=0.03)


def test_top_p_applies_to_the_top_k_survivors() -> None:
    # top_k=2 leaves [0.4, 0.3] -> renormalised [4/7, 3/7]; 4/7 already exceeds top_p=0.55,
    # so only token 0 is left. Top-p over the full row first (0.4 < 0.55) would keep token 1.
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    freq = frequencies(logits, RowParams(top_k=2, top_p=0.55), draws=500)
    assert freq == {0: 1.0}


@pytest.mark.parametrize("draw", [0.0, 1 - 2**-24], ids=["lowest", "highest"])
def test_extreme_uniform_draws_stay_inside_the_nucleus(
    monkeypatch: pytest.MonkeyPatch, draw: float
) -> None:
    # Over a long row, probs.sum() and the cumulative sum round differently by an ulp or two;
    # a draw just under 1 must still land on a token top-p kept, never on one it cut.
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(draw))
    for seed in range(20):
        logits = torch.randn(1, 4096, generator=gen(seed)) * 3
        probs, order = torch.softmax(logits[0], dim=-1).sort(descending=True)
        nucleus = set(order[(probs.cumsum(0) - probs) < 0.9].tolist())
        token = int(sample(logits, [RowParams(top_p=0.9)])[0])
        assert token in nucleus, f"seed {seed}: token {token} is outside the top-p set"
        if draw == 0.0:
            assert token == int(order[0])


def test_top_k_larger_than_vocab_is_no_filter() -> None:
    freq = frequencies([0.0, 0.0], RowParams(top_k=10), draws=2000)
    assert freq[0] == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize(
    ("shape", "rows"),
    [((2, 10), 3), ((3, 10), 2), ((10,), 1), ((1, 2, 10), 1), ((0, 10), 1)],
)
def test_shape_mismatch_raises(shape: tuple[int, ...], rows: int) -> None:
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(shape), [RowParams()] * rows)
