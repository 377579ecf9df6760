"""Penalties (``sampling_penalties``), as every path applies them before sampling: the
greedy token is the argmax of the reference's formulas, whatever the history."""

from __future__ import annotations

import pytest
import torch

from hotpool.kernels.sampling import SamplingRow, sample
from hotpool.kernels.sampling_reference import penalize


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_penalties_follow_the_reference_formulas_in_greedy_outcomes() -> None:
    """Random penalties and histories: the greedy token is the reference's argmax."""
    g = gen(3)
    logits = torch.randn(128, 50, generator=g) * 2
    rows = []
    for i in range(128):
        prompt = torch.randint(0, 50, (int(torch.randint(0, 12, (), generator=g)),), generator=g)
        output = torch.randint(0, 50, (int(torch.randint(0, 12, (), generator=g)),), generator=g)
        rows.append(
            SamplingRow(
                temperature=0.0,
                presence_penalty=[0.0, 0.8, -0.5][i % 3],
                frequency_penalty=[0.0, 0.4, 1.1, -0.3][i % 4],
                repetition_penalty=[1.0, 1.3, 2.5, 0.7, 1.1][i % 5],
                prompt_token_ids=prompt.tolist(),
                output_token_ids=output.tolist(),
            )
        )
    expected = [int(penalize(logits[i], r).argmax()) for i, r in enumerate(rows)]
    before = logits.clone()
    assert sample(logits, rows).token_ids.tolist() == expected
    assert torch.equal(logits, before), "the caller's logits were modified"
    assert expected != logits.argmax(dim=1).tolist(), "the penalties changed nothing"


def test_each_penalty_flips_the_argmax_by_its_formula() -> None:
    logits = torch.tensor([[3.0, 2.0, -1.0, -1.2]] * 4)
    rows = [
        # 3 / 1.6 = 1.875 < 2: token 0 loses
        SamplingRow(temperature=0.0, repetition_penalty=1.6, prompt_token_ids=(0,)),
        # presence counts once: 3 - 0.9 = 2.1 > 2
        SamplingRow(temperature=0.0, presence_penalty=0.9, output_token_ids=(0, 0, 0)),
        # frequency counts every time: 3 - 3 * 0.4 = 1.8 < 2
        SamplingRow(temperature=0.0, frequency_penalty=0.4, output_token_ids=(0, 0, 0)),
        # negative logits are multiplied: -1 * 1.5 = -1.5 < -1.2, so 3 > 2 > -1.2 > -1.5
        SamplingRow(temperature=0.0, top_k=0, repetition_penalty=1.5, prompt_token_ids=(2,)),
    ]
    assert sample(logits, rows).token_ids.tolist() == [1, 0, 1, 0]
    # repetition applies to the output too, presence and frequency to the output only
    row = SamplingRow(temperature=0.0, presence_penalty=5.0, prompt_token_ids=(0,))
    assert sample(logits[:1], [row]).token_ids.tolist() == [0]


def test_penalty_token_ids_outside_the_vocabulary_raise() -> None:
    with pytest.raises(ValueError, match="token ids"):
        sample(torch.zeros(1, 4), [SamplingRow(presence_penalty=1.0, output_token_ids=(4,))])


def test_penalties_work_on_a_strided_view_of_the_logits() -> None:
    hidden = torch.randn(3, 5, 40)
    logits = hidden[:, -1, :]  # not contiguous
    row = SamplingRow(temperature=0.0, repetition_penalty=3.0, output_token_ids=(7, 9))
    expected = [int(penalize(logits[i], row).argmax()) for i in range(3)]
    assert sample(logits, [row] * 3).token_ids.tolist() == expected
