"""The reference sampler against distributions worked out by hand: each filter alone, their
order, greedy rows, penalties, masks; and ``reference_sample``'s outputs and checks."""

from __future__ import annotations

import math

import pytest
import torch

from hotpool.kernels.sampling import NonFiniteLogitsError, SamplingRow
from hotpool.kernels.sampling_reference import penalize, reference_probs, reference_sample

P = [0.4, 0.3, 0.2, 0.1]
LOGITS = torch.tensor([math.log(p) for p in P])


def probs(row: SamplingRow, logits: torch.Tensor = LOGITS) -> list[float]:
    return [round(p, 6) for p in reference_probs(logits, row).tolist()]


def expect(weights: list[float]) -> list[float]:
    return [round(w / sum(weights), 6) for w in weights]


@pytest.mark.parametrize(
    ("row", "weights"),
    [
        (SamplingRow(), P),
        (SamplingRow(temperature=0.5), [p**2 for p in P]),  # p^(1/T)
        (SamplingRow(temperature=2.0), [p**0.5 for p in P]),
        (SamplingRow(top_k=2), [0.4, 0.3, 0, 0]),
        (SamplingRow(top_k=4), P),
        (SamplingRow(top_k=9), P),  # larger than V: off
        # 0.4 and 0.4 + 0.3 are below 0.55 before tokens 1 and 2: token 1 crosses, stays
        (SamplingRow(top_p=0.55), [0.4, 0.3, 0, 0]),
        (SamplingRow(top_p=0.39), [0.4, 0, 0, 0]),  # 0.4 is past 0.39: token 1 is cut
        (SamplingRow(top_p=0.41), [0.4, 0.3, 0, 0]),
        (SamplingRow(min_p=0.49), [0.4, 0.3, 0.2, 0]),  # at least 0.49 * 0.4 = 0.196
        (SamplingRow(min_p=0.76), [0.4, 0, 0, 0]),  # 0.3 < 0.76 * 0.4 = 0.304
        (SamplingRow(temperature=0.0, top_p=0.1), [1, 0, 0, 0]),
        (SamplingRow(temperature=3.0, top_k=1), [1, 0, 0, 0]),
        (SamplingRow(temperature=1e-6), [1, 0, 0, 0]),
    ],
    ids=str,
)
def test_each_filter_alone(row: SamplingRow, weights: list[float]) -> None:
    assert probs(row) == expect(weights)


def test_top_p_applies_to_what_min_p_and_top_k_left_renormalized() -> None:
    logits = torch.tensor([math.log(p) for p in (0.5, 0.3, 0.15, 0.05)])
    # min_p=0.2 keeps 0.5, 0.3, 0.15 (total 0.95). Before token 2 lie 0.8 / 0.95 = 0.842 of
    # the survivors, above top_p = 0.82: cut. Over the whole row (0.8 < 0.82) it would stay.
    assert probs(SamplingRow(min_p=0.2, top_p=0.82), logits) == expect([0.5, 0.3, 0, 0])
    assert probs(SamplingRow(top_p=0.82), logits) == expect([0.5, 0.3, 0.15, 0])
    # top_k=2 leaves 4/7 and 3/7; 4/7 > 0.55 already, so only token 0 is left
    assert probs(SamplingRow(top_k=2, top_p=0.55)) == [1.0, 0, 0, 0]


def test_temperature_applies_before_the_filters() -> None:
    # T=0.5 squares the probabilities: 0.16, 0.09, 0.04, 0.01 of 0.30; min_p=0.3 then keeps
    # those of at least 0.3 * 0.16 = 0.048 (0.04 is out, though 0.2 >= 0.3 * 0.4 before).
    assert probs(SamplingRow(temperature=0.5, min_p=0.3)) == expect([0.16, 0.09, 0, 0])


def test_greedy_is_the_first_of_tied_maxima_after_penalties() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert probs(SamplingRow(temperature=0.0), logits) == [0, 1, 0, 0]
    row = SamplingRow(temperature=0.0, presence_penalty=2.0, output_token_ids=(1, 2))
    assert probs(row, logits) == [0, 0, 0, 1]


def test_ties_at_a_cut_keep_the_lowest_ids() -> None:
    assert probs(SamplingRow(top_k=2), torch.zeros(4)) == [0.5, 0.5, 0, 0]


def test_masked_tokens_have_no_probability() -> None:
    logits = LOGITS.clone()
    logits[0] = float("-inf")
    assert probs(SamplingRow(), logits) == expect([0, 0.3, 0.2, 0.1])


def test_penalties_follow_their_formulas() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    row = SamplingRow(
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        prompt_token_ids=(0, 1),
        output_token_ids=(2, 2, 3),
    )
    # repetition over prompt and output (divide positives, multiply negatives), then
    # presence once and frequency per occurrence over the output
    expected = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 2 * 0.25, 3.0 / 2 - 0.5 - 0.25]
    assert penalize(logits, row).tolist() == pytest.approx(expected)


def test_reference_sample_reports_raw_logprobs_and_the_top_n() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    rows = [SamplingRow(temperature=0.0, num_logprobs=2), SamplingRow(top_k=1)]
    out = reference_sample(logits, rows)
    assert out.token_ids.tolist() == [0, 3]
    torch.testing.assert_close(out.logprobs, torch.tensor([math.log(0.4)] * 2))
    assert out.top_logprobs is not None
    values, ids = out.top_logprobs
    assert ids.tolist() == [[0, 1], [3, 2]]
    torch.testing.assert_close(values, torch.tensor([[math.log(0.4), math.log(0.3)]] * 2))


def test_reference_sample_draws_with_one_uniform_per_sampled_row() -> None:
    g = torch.Generator().manual_seed(5)
    u = torch.rand(1, generator=g).item()  # what the row's generator will give
    expected = next(i for i, c in enumerate(torch.tensor(P).cumsum(0)) if c > u)
    row = SamplingRow(generator=torch.Generator().manual_seed(5))
    assert reference_sample(LOGITS[None], [row]).token_ids.tolist() == [expected]


def test_reference_sample_refuses_rows_without_a_distribution() -> None:
    logits = torch.stack([LOGITS, torch.full((4,), float("-inf"))])
    with pytest.raises(NonFiniteLogitsError, match=r"\[1\]"):
        reference_sample(logits, [SamplingRow(), SamplingRow()])
