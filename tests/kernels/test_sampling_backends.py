"""``sample``'s choice of path and what every path shares: the error for logits with nothing
to sample, rows masked to a single token, seeds and offsets, raw logprobs around the kernel.

The Triton path runs on the CPU in Triton's interpreter here (``backend="triton"``), on CUDA
where there is one.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

import pytest
import torch

from hotpool.kernels import sampling
from hotpool.kernels.sampling import NonFiniteLogitsError, SamplingRow, sample
from hotpool.kernels.sampling_reference import penalize

# In Triton's interpreter tile ops run in numpy, which warns about overflow or NaN in lanes
# the kernel then masks out (rows with +inf, logits near float32's limits).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

BACKENDS = ["torch", "reference", "triton"]


def device_for(backend: str) -> torch.device:
    if backend != "triton":
        return torch.device("cpu")
    pytest.importorskip("triton")
    from hotpool.kernels.triton_sampling import kernel_device

    return kernel_device()


def run(logits: torch.Tensor, rows: list[SamplingRow], backend: str) -> Any:
    return sample(logits.to(device_for(backend)), rows, backend=backend)


# --- the choice of path -------------------------------------------------------------------


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        sample(torch.zeros(1, 4), [SamplingRow()], backend="cuda")


def test_cpu_logits_take_the_torch_path_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_triton(*args: object) -> None:
        raise AssertionError("the Triton path ran")

    monkeypatch.setattr(sampling, "_sample_triton", no_triton)
    assert sample(torch.tensor([[0.0, 3.0]]), [SamplingRow(temperature=0.0)]).token_ids == 1


def test_the_triton_backend_without_triton_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "_triton_kernels", lambda: None)
    with pytest.raises(ValueError, match="needs the triton package"):
        sample(torch.zeros(1, 4), [SamplingRow()], backend="triton")


# --- logits with nothing to sample --------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inf_and_empty_rows_raise_naming_the_rows(backend: str) -> None:
    x = torch.randn(6, 50)
    x[1, 7] = float("nan")
    x[3, 0] = float("inf")
    x[4] = float("-inf")
    rows = [SamplingRow(), SamplingRow(temperature=0.0), SamplingRow(top_k=5)] * 2
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[1, 3, 4\]") as info:
        run(x, rows, backend)
    assert info.value.rows == (1, 3, 4)
    assert isinstance(info.value, ValueError)  # a bad input, as the server reports it


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_under_penalties_and_top_logprobs_still_raises(backend: str) -> None:
    x = torch.randn(2, 30)
    x[0, 3] = float("nan")
    row = SamplingRow(presence_penalty=1.0, output_token_ids=(3, 4), num_logprobs=2)
    with pytest.raises(NonFiniteLogitsError) as info:
        run(x, [row, row], backend)
    assert info.value.rows == (0,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_kind_of_row_with_nan_raises_rather_than_crashing(backend: str) -> None:
    kinds = [
        SamplingRow(temperature=0.0),
        SamplingRow(),
        SamplingRow(temperature=0.5),
        SamplingRow(top_k=3),
        SamplingRow(top_p=0.5),
        SamplingRow(top_p=0.01, temperature=2.0),
        SamplingRow(min_p=0.2),
        SamplingRow(top_k=40, top_p=0.9, min_p=0.05, num_logprobs=5),
    ]
    x = torch.full((len(kinds), 300), float("nan"))
    x[::2, ::7] = 1.0  # some rows partly NaN, some all NaN
    with pytest.raises(NonFiniteLogitsError) as info:
        run(x, kinds, backend)
    assert info.value.rows == tuple(range(len(kinds)))


def test_the_error_survives_pickling_with_its_rows() -> None:
    err = pickle.loads(pickle.dumps(NonFiniteLogitsError(list(range(20)))))
    assert err.rows == tuple(range(20))
    assert "0, 1, 2" in str(err) and "..." in str(err)


MASKED_ROWS = [
    SamplingRow(temperature=0.0),
    SamplingRow(),
    SamplingRow(temperature=0.3, top_k=3),
    SamplingRow(top_p=0.2),
    SamplingRow(min_p=0.5),
    SamplingRow(temperature=2.0, top_k=10, top_p=0.9, min_p=0.1, num_logprobs=3),
    SamplingRow(presence_penalty=2.0, output_token_ids=(0, 1)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_masked_to_one_token_samples_it(backend: str, dtype: torch.dtype) -> None:
    n = len(MASKED_ROWS)
    only = torch.tensor([0, 63, 17, 5, 40, 1, 62])
    x = torch.full((n, 64), float("-inf")).scatter_(1, only[:, None], -5.0).to(dtype)
    out = run(x, MASKED_ROWS, backend)
    assert out.token_ids.tolist() == only.tolist()
    assert out.logprobs.tolist() == [0.0] * n  # the only token is certain


# --- seeds and offsets --------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_seed_and_offset_give_the_same_token_alone_and_in_a_batch(backend: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    rows = [SamplingRow(top_p=0.9, seed=11, offset=i) for i in range(8)]
    batch = run(logits, rows, backend).token_ids.tolist()
    alone = [int(run(logits[i : i + 1], rows[i : i + 1], backend).token_ids[0]) for i in (2, 7)]
    assert alone == [batch[2], batch[7]]
    torch.manual_seed(1)  # the default generator plays no part in a seeded row
    assert run(logits, rows, backend).token_ids.tolist() == batch


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_offset_draws_afresh(backend: str) -> None:
    flat = torch.zeros(64, 500)  # uniform: 64 draws from 500 tokens nearly never repeat much
    rows = [SamplingRow(seed=5, offset=i) for i in range(64)]
    assert len(set(run(flat, rows, backend).token_ids.tolist())) > 50
    other_seed = [replace(r, seed=6) for r in rows]
    assert (
        run(flat, other_seed, backend).token_ids.tolist()
        != run(flat, rows, backend).token_ids.tolist()
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_generator_seeds_a_row_on_every_path(backend: str) -> None:
    flat = torch.zeros(1, 1000)

    def tokens(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [int(run(flat, [SamplingRow(generator=g)], backend).token_ids[0]) for _ in range(5)]

    assert tokens(3) == tokens(3)
    assert tokens(3) != tokens(4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unseeded_rows_follow_torch_manual_seed(backend: str) -> None:
    flat = torch.zeros(16, 1000)
    torch.manual_seed(9)
    first = run(flat, [SamplingRow()] * 16, backend).token_ids.tolist()
    torch.manual_seed(9)
    assert run(flat, [SamplingRow()] * 16, backend).token_ids.tolist() == first


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"offset": -1}, "offset")],
)
def test_seeds_and_offsets_out_of_range_raise(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingRow(**kwargs)  # type: ignore[arg-type]


# --- logprobs and penalties around the kernel ---------------------------------------------


def test_the_triton_path_reports_raw_logprobs_under_penalties() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 120) * 2
    rows = [
        SamplingRow(temperature=0.0, repetition_penalty=3.0, prompt_token_ids=tuple(range(60))),
        SamplingRow(
            temperature=0.0, presence_penalty=5.0, output_token_ids=(int(logits[1].argmax()),)
        ),
        SamplingRow(top_k=5, frequency_penalty=1.0, output_token_ids=(1, 1, 2), num_logprobs=4),
        SamplingRow(temperature=0.0, num_logprobs=2),
    ]
    out = run(logits, rows, "triton")
    expected_greedy = [int(penalize(logits[i], rows[i]).argmax()) for i in (0, 1, 3)]
    assert [out.token_ids[i] for i in (0, 1, 3)] == expected_greedy
    raw = torch.log_softmax(logits, dim=1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs is not None
    values, ids = out.top_logprobs
    expected = torch.topk(raw, 4, dim=1)
    assert torch.equal(ids, expected.indices)
    torch.testing.assert_close(values, expected.values)


# --- rows that read no logprob ------------------------------------------------------------


def test_a_batch_that_reads_no_logprob_gets_the_same_tokens_and_nan_logprobs() -> None:
    torch.manual_seed(8)
    x = torch.randn(6, 300) * 2
    kinds = [SamplingRow(temperature=0.0), SamplingRow(seed=5, top_p=0.9), SamplingRow(top_k=7)]
    rows = [replace(kinds[i % 3], seed=40 + i) for i in range(6)]
    full = sample(x, rows, backend="torch")
    lean = sample(x, [replace(r, logprob=False) for r in rows], backend="torch")
    assert lean.token_ids.tolist() == full.token_ids.tolist()
    assert lean.logprobs.isnan().all() and lean.top_logprobs is None
    assert not full.logprobs.isnan().any()
    # One row asking is enough for every row to get its logprob.
    mixed = sample(x, [replace(r, logprob=i == 3) for i, r in enumerate(rows)], backend="torch")
    torch.testing.assert_close(mixed.logprobs, full.logprobs)
    # So is a row asking for top-N only.
    top = [replace(r, logprob=False, num_logprobs=2 if i == 0 else 0) for i, r in enumerate(rows)]
    assert not sample(x, top, backend="torch").logprobs.isnan().any()


@pytest.mark.parametrize("bad", ["nan", "inf", "all -inf"])
def test_a_batch_that_reads_no_logprob_still_finds_rows_with_nothing_to_sample(bad: str) -> None:
    x = torch.randn(4, 50)
    if bad == "all -inf":
        x[2] = float("-inf")
    else:
        x[2, 9] = float(bad)
    rows = [SamplingRow(temperature=0.0, logprob=False), SamplingRow(top_p=0.8, logprob=False)]
    with pytest.raises(NonFiniteLogitsError) as info:
        sample(x, rows * 2, backend="torch")
    assert info.value.rows == (2,)
