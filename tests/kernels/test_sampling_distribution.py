"""Every path draws from the exact filtered distribution: 20,000 draws per case over a small
vocabulary, against ``reference_probs``, pass a chi-square test at p > 0.001.

One call samples the same row 20,000 times (one row per draw; on the Triton path each row
gets its own Philox seed), so a case costs one launch. Without a GPU the Triton kernel runs in
Triton's CPU interpreter, where one launch of 20,000 rows over 50-200 tokens takes 0.5-8 s;
the reference loops over rows in Python (~2 s a case). Both get fewer cases than the torch
path.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from hotpool.kernels import sampling_torch
from hotpool.kernels.sampling import SamplingRow, sample
from hotpool.kernels.sampling_reference import reference_probs

DRAWS = 20_000
P_MIN = 1e-3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square test of ``counts`` against ``probs``.

    Bins expected fewer than 5 times are pooled (into the smallest other bin if the pool
    itself stays under 5). No count may fall outside the support.
    """
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


def test_chi_square_p_values_are_right() -> None:
    # df = 2: the survival function is exp(-x / 2); observed (60, 20, 20) vs 100/3 each:
    # x = (26.67^2 + 2 * 13.33^2) / 33.33 = 32.0
    p = chi_square_p(torch.tensor([60, 20, 20]), torch.full((3,), 1 / 3))
    assert math.isclose(p, math.exp(-16.0), rel_tol=1e-5)
    # df = 1 at x = 3.841: the textbook 5% point
    p = chi_square_p(torch.tensor([5980, 4020]), torch.tensor([0.6, 0.4]))
    stat = 20.0**2 / 6000 + 20.0**2 / 4000
    assert math.isclose(p, math.erfc(math.sqrt(stat / 2)), rel_tol=1e-5)
    assert chi_square_p(torch.tensor([7, 0]), torch.tensor([1.0, 0.0])) == 1.0


def logits_for(vocab: int, scale: float, masked: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab * 1000 + int(scale * 10))
    x = torch.randn(vocab, generator=g) * scale
    if masked:  # a grammar's mask: every third token is impossible
        x[::3] = float("-inf")
    return x


# (vocab, scale, masked, row); logits are distinct, so no tie decides a cut.
CASES: dict[str, tuple[int, float, bool, SamplingRow]] = {
    "T=1": (50, 1.5, False, SamplingRow()),
    "T=0.5": (131, 1.0, False, SamplingRow(temperature=0.5)),
    "T=1.7": (200, 2.0, False, SamplingRow(temperature=1.7)),
    "top_k=5": (50, 1.0, False, SamplingRow(top_k=5)),
    "top_k=37,T=1.3": (131, 2.0, False, SamplingRow(temperature=1.3, top_k=37)),
    "top_k>V": (96, 1.0, False, SamplingRow(top_k=500)),
    "top_p=0.9": (200, 2.0, False, SamplingRow(top_p=0.9)),
    "top_p=0.6,T=0.7": (131, 1.0, False, SamplingRow(temperature=0.7, top_p=0.6)),
    "top_p=0.3": (50, 1.0, False, SamplingRow(top_p=0.3)),
    "min_p=0.05": (200, 2.0, False, SamplingRow(min_p=0.05)),
    "min_p=0.2,T=1.4": (96, 1.0, False, SamplingRow(temperature=1.4, min_p=0.2)),
    # Kept tokens hold ~1/5 of the mass at T=3: the Triton kernel's draws at T are rejected
    # four times in a row for ~40% of the rows, which then weigh the kept tokens.
    "min_p=0.6,T=3": (200, 1.0, False, SamplingRow(temperature=3.0, min_p=0.6)),
    "top_k=20,top_p=0.8": (96, 1.5, False, SamplingRow(top_k=20, top_p=0.8)),
    "min_p=0.05,top_p=0.85": (131, 1.5, False, SamplingRow(min_p=0.05, top_p=0.85)),
    "all filters": (
        200,
        2.0,
        False,
        SamplingRow(temperature=1.3, min_p=0.02, top_k=40, top_p=0.9),
    ),
    "masked,top_p=0.9": (96, 1.5, True, SamplingRow(top_p=0.9)),
    "penalties,top_p=0.95": (
        64,
        1.5,
        False,
        SamplingRow(
            top_p=0.95,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.4,
            prompt_token_ids=(0, 5, 9),
            output_token_ids=(1, 1, 2, 6, 40),
        ),
    ),
}
# The slower paths get a spread of the cases: each filter alone, combined, masked, penalized.
REFERENCE_CASES = ["T=0.5", "top_k=37,T=1.3", "min_p=0.05,top_p=0.85", "penalties,top_p=0.95"]
TRITON_CASES = [
    "T=1",
    "T=1.7",
    "top_k=5",
    "top_k>V",
    "top_p=0.6,T=0.7",
    "top_p=0.3",
    "min_p=0.2,T=1.4",
    "min_p=0.6,T=3",
    "top_k=20,top_p=0.8",
    "all filters",
    "masked,top_p=0.9",
    "penalties,top_p=0.95",
]


@pytest.fixture(autouse=True)
def fixed_seed() -> Iterator[None]:
    torch.manual_seed(2024)  # unseeded rows draw from the default generator
    yield


def check_case(name: str, backend: str, device: torch.device | str = "cpu") -> None:
    vocab, scale, masked, row = CASES[name]
    x = logits_for(vocab, scale, masked)
    tokens = sample(x.to(device).expand(DRAWS, -1), [row] * DRAWS, backend=backend).token_ids
    counts = torch.bincount(tokens, minlength=vocab)
    p = chi_square_p(counts, reference_probs(x, row))
    assert p > P_MIN, f"{backend} {name}: chi-square p = {p:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_draws_the_exact_distribution(name: str) -> None:
    check_case(name, "torch")


@pytest.mark.parametrize("name", ["T=1.7", "top_p=0.3", "min_p=0.2,T=1.4", "masked,top_p=0.9"])
def test_torch_path_without_the_c_kernels_draws_the_exact_distribution(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the C kernels do not load (or off the CPU) the sampler's softmax and nucleus
    check stay in torch."""
    monkeypatch.setattr(sampling_torch, "_native", lambda x: None)
    check_case(name, "torch")


@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_reference_draws_the_exact_distribution(name: str) -> None:
    check_case(name, "reference")


@pytest.mark.slow
@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_kernel_draws_the_exact_distribution(name: str) -> None:
    pytest.importorskip("triton")
    from hotpool.kernels.triton_sampling import kernel_device

    check_case(name, "triton", kernel_device())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["T=1.7", "top_p=0.6,T=0.7", "all filters", "masked,top_p=0.9"])
def test_triton_kernel_draws_the_exact_distribution_from_narrow_tiles(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 16 lanes a draw first picks a lane holding up to 13 tokens, then a token in it:
    both steps are exercised, where the default width gives every token a lane of its own."""
    pytest.importorskip("triton")
    from hotpool.kernels import triton_sampling

    monkeypatch.setattr(triton_sampling, "_CPU_BLOCK", 16)
    monkeypatch.setattr(triton_sampling, "GPU_BLOCK", 16)
    check_case(name, "triton", triton_sampling.kernel_device())
