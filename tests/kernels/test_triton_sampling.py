"""The Triton sampler under the CPU interpreter against an exact, sort-based reference.

``TRITON_INTERPRET`` is set before anything imports triton: the interpreter is chosen when
the kernels are decorated, at import time. It runs every program in Python, tens of
milliseconds per row, so vocabularies and batches stay small here.
"""

from __future__ import annotations

import os
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from hotpool.kernels.triton_sampling import triton_sample


def params(
    b: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 1234,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    return (
        torch.full((b,), temperature, dtype=torch.float32),
        torch.full((b,), top_k, dtype=torch.int32),
        torch.full((b,), top_p, dtype=torch.float32),
        torch.full((b,), min_p, dtype=torch.float32),
        torch.full((b,), seed, dtype=torch.int64),
        torch.arange(b, dtype=torch.int64) if offsets is None else offsets,
    )


def reference_probs(
    row: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """The exact distribution the filters leave (order of ``hotpool.kernels.sampling``):
    temperature, min_p, top_k, top_p; float64, the whole row sorted."""
    x = row.double()
    values, ids = x.sort(descending=True)
    w = torch.exp((values - values[0]) / temperature)
    keep = w >= min_p
    if 0 < top_k < len(x):
        keep &= torch.arange(len(x)) < top_k
    w = torch.where(keep, w, 0.0)
    heavier = w.cumsum(0) - w  # survivors strictly before each token
    w = torch.where(heavier < top_p * w.sum(), w, 0.0)
    probs = torch.zeros_like(x)
    probs[ids] = w / w.sum()
    return probs


def draws(row: torch.Tensor, n: int, **kw: Any) -> torch.Tensor:
    """``n`` draws from one row: ``n`` copies in one launch, one offset each."""
    tokens, _ = triton_sample(row.expand(n, -1).contiguous(), *params(n, **kw))
    return tokens


def test_greedy_rows_take_the_first_argmax() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 257)
    x[3, 10] = x[3, 200] = 50.0  # a tie: the lowest index wins
    temperature, top_k, *rest = params(6, temperature=0.0, top_p=0.5)
    top_k[5], temperature[5] = 1, 0.7  # top_k == 1 is greedy whatever the temperature
    tokens, _ = triton_sample(x, temperature, top_k, *rest)
    assert tokens.tolist() == x.argmax(dim=1).tolist()
    assert tokens[3] == 10


def test_logprobs_are_raw_log_softmax_at_the_sampled_token() -> None:
    torch.manual_seed(1)
    x = torch.randn(8, 130) * 4
    temperature, top_k, top_p, min_p, seeds, offsets = params(8)
    temperature[:2] = 0.0
    temperature[2:] = torch.tensor([0.5, 2.0, 1.0, 0.7, 1.3, 0.9])
    top_k[4], top_p[5], min_p[6] = 7, 0.8, 0.1
    tokens, logprobs = triton_sample(x, temperature, top_k, top_p, min_p, seeds, offsets)
    expected = torch.log_softmax(x, dim=1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)


def test_a_seed_and_offset_give_the_same_token_wherever_the_row_sits() -> None:
    torch.manual_seed(2)
    x = torch.randn(6, 90)
    p = params(6, temperature=1.5, offsets=torch.tensor([5, 9, 11, 3, 0, 7]))
    p[1][3] = 10  # one top_k row: the draw is a function of (seed, offset) there too
    first, _ = triton_sample(x, *p)
    perm = torch.tensor([4, 2, 0, 5, 1, 3])
    again, _ = triton_sample(x[perm], *(t[perm] for t in p))
    assert again.tolist() == first[perm].tolist()
    # One row with many offsets: different offsets give different draws.
    flat = torch.zeros(1, 90)
    tokens = draws(flat[0], 40, temperature=1.0)
    assert len(set(tokens.tolist())) > 15


@pytest.mark.parametrize(
    ("n", "kw"),
    [
        (400, {"temperature": 1.3}),
        (160, {"temperature": 0.8, "top_k": 4}),
        (160, {"temperature": 1.0, "top_p": 0.6}),
        (160, {"temperature": 1.0, "min_p": 0.3}),
        (160, {"temperature": 2.0, "top_k": 6, "top_p": 0.8, "min_p": 0.05}),
    ],
)
def test_draws_follow_the_exact_filtered_distribution(n: int, kw: dict[str, Any]) -> None:
    torch.manual_seed(3)
    row = torch.randn(60) * 1.5
    probs = reference_probs(row, **kw)
    tokens = draws(row, n, **kw)
    assert ((tokens >= 0) & (tokens < 60)).all()
    assert (probs[tokens] > 0).all(), "a filtered-out token was drawn"
    freq = torch.bincount(tokens, minlength=60).double() / n
    # 5 sigma per token (plus a 1/n floor): deterministic seeds, and a bound that a correct
    # sampler fails with probability ~1e-5 over all tokens, not a tuned one.
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1.0 / n).all()


def test_rows_longer_than_one_block() -> None:
    torch.manual_seed(5)
    x = torch.randn(3, 2500)  # three blocks of 1024, the last one short
    x[1, 2400] = 9.0  # the maximum in the short block
    x[2, 100] = x[2, 2000] = 9.0  # a tie across blocks: the first block's wins
    tokens, _ = triton_sample(x, *params(3, temperature=0.0))
    assert tokens.tolist() == [int(x[0].argmax()), 2400, 100]
    tokens, logprobs = triton_sample(x, *params(3, top_k=5, top_p=0.95))
    assert (x.topk(5, dim=1).indices == tokens[:, None]).any(dim=1).all()
    expected = torch.log_softmax(x, dim=1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [1e-30, 1e-38, 1e30])
def test_tiny_and_huge_logits_stay_inside_the_filtered_set(scale: float) -> None:
    torch.manual_seed(6)
    row = torch.randn(77) * 4
    n = 24
    for kw in ({"top_k": 5}, {"top_p": 0.3}, {"min_p": 0.5}):
        tokens = draws(row * scale, n, temperature=scale, **kw)
        allowed = reference_probs(row, **kw) > 0
        assert allowed[tokens].all(), kw


def test_tied_logits_at_the_cut_all_stay() -> None:
    """Documented difference from a sort: top_k and top_p cut at a logit, not a rank."""
    tokens = draws(torch.zeros(40), 60, top_k=3, top_p=0.1)
    assert len(set(tokens.tolist())) > 10


def test_bf16_and_fp16_logits_are_accepted() -> None:
    torch.manual_seed(4)
    x = torch.randn(4, 75)
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        tokens, logprobs = triton_sample(low, *params(4, temperature=0.0))
        assert tokens.tolist() == low.float().argmax(dim=1).tolist()
        expected = torch.log_softmax(low.float(), dim=1).gather(1, tokens[:, None]).squeeze(1)
        torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
        tokens, _ = triton_sample(low, *params(4, top_k=3))
        top3 = low.float().topk(3, dim=1).indices
        assert (top3 == tokens[:, None]).any(dim=1).all()


def test_rows_with_nan_or_no_finite_logit_get_no_token() -> None:
    x = torch.zeros(3, 64)
    x[0, 5] = float("nan")
    x[1] = float("-inf")
    x[2, :63] = float("-inf")  # one finite token: always that one
    tokens, logprobs = triton_sample(x, *params(3, top_p=0.5))
    assert tokens.tolist() == [-1, -1, 63]
    assert logprobs[:2].isnan().all() and logprobs[2] == 0.0


def test_bad_inputs_raise_value_error() -> None:
    x = torch.randn(3, 50)
    good = params(3)
    with pytest.raises(ValueError, match="logits must be"):
        triton_sample(x[0], *good)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        triton_sample(x.double(), *good)
    with pytest.raises(ValueError, match="contiguous"):
        triton_sample(torch.randn(50, 3).t(), *good)
    with pytest.raises(ValueError, match=r"top_k must be torch.int32"):
        triton_sample(x, good[0], good[1].long(), *good[2:])
    with pytest.raises(ValueError, match=r"temperature must be a \[3\] tensor"):
        triton_sample(x, good[0][:2], *good[1:])
    with pytest.raises(ValueError, match="offsets must be contiguous"):
        triton_sample(x, *good[:5], torch.arange(6)[::2])
