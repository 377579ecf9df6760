"""Fuzzing every path with awkward rows: -inf everywhere but one token, all-equal logits,
huge and tiny magnitudes, vocabularies that are not powers of two, bf16, ties. Whatever the
row, the token is in [0, V) and inside the set the row's filters keep; greedy and top_k=1
rows take the first argmax; a seeded row's token does not depend on where it sits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hotpool.kernels.sampling import SamplingRow, sample
from hotpool.kernels.sampling_penalties import apply_penalties
from hotpool.kernels.sampling_reference import penalize, reference_probs

# In Triton's interpreter tile ops run in numpy, which warns about overflow or NaN in lanes
# the kernel then masks out (rows with +inf, logits near float32's limits).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

NO_PENALTY = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
# top_p values whose multiples by V <= 300 stay >= 0.001 away from an integer, so over
# near-uniform rows no float rounding decides the top-p crossing.
TOP_P = [1.0, 0.9137, 0.5771, 0.3119, 0.0133, 0.7431, 0.6623]
SCALES = [1e-30, 1e-6, 1.0, 8.0, 1e4, 1e30, 1e37]


@st.composite
def rows_for(draw: st.DrawFn, v: int) -> SamplingRow:
    penalized = draw(st.booleans())
    return SamplingRow(
        temperature=draw(st.sampled_from([0.0, 1e-6, 2e-5, 0.05, 0.3, 0.7, 1.0, 1.6, 3.0])),
        top_k=draw(st.sampled_from([0, 1, 2, 5, max(v - 1, 0), v, v + 3])),
        top_p=draw(st.sampled_from(TOP_P)),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.5, 0.93])),
        presence_penalty=0.7 if penalized else 0.0,
        repetition_penalty=1.3 if penalized else 1.0,
        output_token_ids=tuple(draw(st.lists(st.integers(0, v - 1), max_size=5))),
        seed=draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))),
        offset=draw(st.integers(0, 10**6)),
    )


@st.composite
def batches(draw: st.DrawFn, max_rows: int = 5) -> tuple[torch.Tensor, list[SamplingRow]]:
    v = draw(st.integers(1, 300))
    b = draw(st.integers(1, max_rows))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from(SCALES))
    kind = draw(st.sampled_from(["normal", "equal", "one finite", "masked"]))
    x = torch.randn(b, v, generator=g) * scale
    if kind == "equal":
        x = torch.full((b, v), scale)
    elif kind == "one finite":
        keep = torch.randint(0, v, (b,), generator=g)
        x = torch.full((b, v), float("-inf")).scatter_(1, keep[:, None], x[:, :1])
    elif kind == "masked":  # half the tokens masked, never all of a row
        x[torch.rand(b, v, generator=g) < 0.5] = float("-inf")
        x[:, v // 2] = scale
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return x.to(dtype), [draw(rows_for(v)) for _ in range(b)]


def penalized(logits: torch.Tensor, row: SamplingRow, backend: str) -> torch.Tensor:
    """The row's logits after penalties, as the path computes them (float64 or float32)."""
    if backend == "reference":
        return penalize(logits, row)
    return apply_penalties(logits.float()[None], [row])[0].double()


def allowed(logits: torch.Tensor, row: SamplingRow, backend: str) -> torch.Tensor:
    """The tokens a path may draw for ``row``: the reference's support, closed over ties.

    Where tokens tie at a cut, paths keep different ones (the Triton kernel all of them), and
    distinct logits may tie in weight once ``exp`` rounds (the rejection path keeps those).
    So every token at least as large as a kept one, by logit or by weight in float64 or
    float32, is allowed. The fast paths penalize in float32: their set comes from their own
    penalized logits, with top_p and min_p loosened by 1e-4 so no rounding at a cut decides.
    """
    if backend == "reference":
        x, probs = penalize(logits, row), reference_probs(logits, row)
    else:
        x = penalized(logits, row, backend)
        loose = replace(
            row, top_p=min(1.0, row.top_p + 1e-4), min_p=max(0.0, row.min_p - 1e-4), **NO_PENALTY
        )
        probs = reference_probs(x, loose)
    kept = probs > 0
    keep = x >= x[kept].min()
    for w in (
        x.sub(x.max()).div(row.temperature).exp(),
        x.float().sub(x.float().max()).div(row.temperature).exp(),
    ):
        if w[kept].min() > 0:
            keep |= w >= w[kept].min()
    return keep & (x > float("-inf"))


def on_path(logits: torch.Tensor, rows: list[SamplingRow], backend: str) -> list[int]:
    """The path's tokens; the Triton path's logits go where its kernel runs."""
    if backend == "triton":
        pytest.importorskip("triton")
        from hotpool.kernels.triton_sampling import kernel_device

        logits = logits.to(kernel_device())
    return sample(logits, rows, backend=backend).token_ids.tolist()


def check(logits: torch.Tensor, rows: list[SamplingRow], backend: str) -> None:
    tokens = on_path(logits, rows, backend)
    v = logits.shape[1]
    for i, row in enumerate(rows):
        t = tokens[i]
        assert 0 <= t < v, f"row {i}: token {t} outside [0, {v})"
        if row.greedy:
            first_max = int(penalized(logits[i], row, backend).argmax())
            assert t == first_max, f"row {i}: greedy token {t}, argmax {first_max}, {row}"
        else:
            assert allowed(logits[i], row, backend)[t], f"row {i}: token {t} filtered, {row}"


@pytest.mark.parametrize(("backend", "examples"), [("torch", 150), ("reference", 60)])
def test_every_token_is_valid_and_kept_by_the_filters(backend: str, examples: int) -> None:
    # Derandomized, with torch's generator seeded per example: unseeded rows draw from it,
    # and a failure must replay. (A rare one seen at 3,000 random examples: near-uniform
    # logits of scale 1e-6 with top_p=0.31 drew a token just outside the float64 nucleus,
    # where float32 weights tie; to be looked into.)
    @settings(max_examples=examples, deadline=None, derandomize=True)
    @given(batches())
    def run(batch: tuple[torch.Tensor, list[SamplingRow]]) -> None:
        torch.manual_seed(0)
        check(*batch, backend)

    run()


@pytest.mark.slow
@settings(max_examples=50, deadline=None, derandomize=True)  # replayable: see above
@given(batches())
def test_every_triton_token_is_valid_and_kept_by_the_filters(
    batch: tuple[torch.Tensor, list[SamplingRow]],
) -> None:
    torch.manual_seed(0)
    check(*batch, "triton")


def seeded(rows: list[SamplingRow], seed: int) -> list[SamplingRow]:
    return [replace(r, seed=seed + i, offset=3 * i) for i, r in enumerate(rows)]


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
@settings(max_examples=25, deadline=None)
@given(batch=batches(max_rows=6), data=st.data())
def test_a_seeded_row_gets_its_token_wherever_it_sits(
    backend: str, batch: tuple[torch.Tensor, list[SamplingRow]], data: Any
) -> None:
    logits, rows = batch
    rows = seeded(rows, data.draw(st.integers(0, 2**62)))
    first = on_path(logits, rows, backend)
    perm = data.draw(st.permutations(range(len(rows))))
    # the permuted rows, then the first one again in a batch of a different size
    order = [*perm, perm[0]]
    again = on_path(logits[order], [rows[i] for i in order], backend)
    assert again == [first[i] for i in order]


@settings(max_examples=30, deadline=None)
@given(batches(max_rows=6))
def test_greedy_tokens_agree_on_every_path(batch: tuple[torch.Tensor, list[SamplingRow]]) -> None:
    logits, rows = batch
    rows = [replace(r, temperature=0.0, **NO_PENALTY) for r in rows]
    tokens = {
        backend: on_path(logits, rows, backend) for backend in ("torch", "triton", "reference")
    }
    assert tokens["torch"] == tokens["triton"] == tokens["reference"]
    assert tokens["torch"] == logits.float().argmax(dim=1).tolist()
