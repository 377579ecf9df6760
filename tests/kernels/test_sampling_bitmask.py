"""The grammar's token bitmask (``sample(..., token_bitmask=...)``) on every path: the CPU's
C sampler, the torch code (the C library disabled), the Triton kernel (interpreted on the
CPU, with its narrow-tile, whole-row-search and overflowing-candidates variants) and the
reference. Disallowed tokens are never drawn, greedy is the argmax over allowed ones, the
filters see only allowed tokens (chi-square against the reference's masked distribution),
an all-ones mask changes no token, logprobs stay raw, and bad masks or rows are refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from test_sampling_distribution import chi_square_p

from hotpool.kernels import cpu_ops, sampling_torch
from hotpool.kernels.sampling import NonFiniteLogitsError, SamplingRow, sample
from hotpool.kernels.sampling_bitmask import allowed_tokens
from hotpool.kernels.sampling_reference import penalize, reference_probs

# In Triton's interpreter tile ops run in numpy, which warns about overflow in lanes the
# kernel then masks out.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

# "c": the torch backend on the CPU with its C sampler; "torch": the same with the C library
# treated as absent (the torch code other devices run); "triton*": the kernel, interpreted,
# at its default tiles, with 16 lanes, with no candidate slots (every filtered row searched
# over the whole row) and with one slot (candidates overflow and are narrowed).
BACKENDS = ["c", "torch", "triton", "reference"]
TRITON_VARIANTS = ["triton", "triton-narrow", "triton-no-slots", "triton-one-slot"]

ROW_KINDS = [
    SamplingRow(temperature=0.0),
    SamplingRow(),
    SamplingRow(temperature=0.5),
    SamplingRow(top_k=5),
    SamplingRow(top_p=0.6),
    SamplingRow(min_p=0.3),
    SamplingRow(temperature=1.3, top_k=20, top_p=0.9, min_p=0.05, num_logprobs=2),
    SamplingRow(presence_penalty=2.0, repetition_penalty=1.5, output_token_ids=(0, 0)),
]


@pytest.fixture(autouse=True)
def fixed_seed() -> None:
    torch.manual_seed(77)  # unseeded rows draw from the default generator


def use(backend: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, torch.device]:
    """Sets the variant up; returns ``sample``'s backend and the logits' device."""
    if backend == "c":
        if cpu_ops.load() is None:
            pytest.skip("the C kernels do not build here")
        return "torch", torch.device("cpu")
    if backend == "torch":
        monkeypatch.setattr(sampling_torch, "_native", lambda x: None)
        return "torch", torch.device("cpu")
    if backend == "reference":
        return "reference", torch.device("cpu")
    pytest.importorskip("triton")
    from hotpool.kernels import triton_sampling

    if backend == "triton-narrow":
        monkeypatch.setattr(triton_sampling, "_CPU_BLOCK", 16)
        monkeypatch.setattr(triton_sampling, "GPU_BLOCK", 16)
    elif backend in ("triton-no-slots", "triton-one-slot"):
        slots = 0 if backend == "triton-no-slots" else 1
        monkeypatch.setattr(triton_sampling, "_CPU_SLOTS", slots)
        monkeypatch.setattr(triton_sampling, "GPU_SLOTS", slots)
    return "triton", triton_sampling.kernel_device()


def pack(allowed: torch.Tensor, junk: bool = True) -> torch.Tensor:
    """The bitmask of bool ``[B, V]`` in llguidance's layout, bits past V random when
    ``junk`` (they must be ignored)."""
    b, v = allowed.shape
    words = (v + 31) // 32
    bits = torch.zeros(b, words * 32, dtype=torch.int64)
    if junk:
        bits[:, v:] = torch.randint(0, 2, (b, words * 32 - v))
    bits[:, :v] = allowed.long()
    value = (bits.view(b, words, 32) << torch.arange(32)).sum(dim=2)
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


def random_allowed(b: int, v: int, density: float, g: torch.Generator) -> torch.Tensor:
    """Each row allows each token with probability ``density``, and at least one token."""
    allowed = torch.rand(b, v, generator=g) < density
    allowed[torch.arange(b), torch.randint(0, v, (b,), generator=g)] = True
    return allowed


def run(
    x: torch.Tensor, rows: list[SamplingRow], mask: torch.Tensor | None, how: tuple[str, Any]
) -> Any:
    backend, dev = how
    return sample(x.to(dev), rows, backend=backend, token_bitmask=mask)


def test_pack_is_the_layout_the_sampler_reads() -> None:
    allowed = torch.zeros(2, 40, dtype=torch.bool)
    allowed[0, [0, 31, 32, 39]] = True
    mask = pack(allowed, junk=False)
    assert mask.tolist() == [[1 - 2**31, 1 | (1 << 7)], [0, 0]]
    assert torch.equal(allowed_tokens(mask, 40), allowed)


# --- which tokens come out ----------------------------------------------------------------


@pytest.mark.parametrize("v", [1, 31, 33, 1000, 50257])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_sampled_token_is_allowed_and_greedy_is_the_allowed_argmax(
    backend: str, v: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "triton" and v > 1000:
        pytest.skip("the interpreter's launch over 50257 tokens takes too long")
    how = use(backend, monkeypatch)
    g = torch.Generator().manual_seed(v)
    rows = ROW_KINDS * 2
    x = torch.randn(len(rows), v, generator=g) * 3
    # half the rows allow few tokens, half most; the largest logit is disallowed in most
    density = torch.tensor([0.05, 0.7]).repeat_interleave(len(ROW_KINDS))
    allowed = torch.rand(len(rows), v, generator=g) < density[:, None]
    allowed[torch.arange(len(rows)), x.argmax(dim=1)] = v == 1
    allowed[torch.arange(len(rows)), torch.randint(0, v, (len(rows),), generator=g)] = True
    mask = pack(allowed)
    for _ in range(1 if how[0] == "triton" else 3):
        tokens = run(x, rows, mask, how).token_ids
        assert allowed.gather(1, tokens[:, None]).all(), f"drew a disallowed token: {tokens}"
        for i in (0, len(ROW_KINDS)):  # the greedy rows
            assert tokens[i] == torch.where(allowed[i], x[i], float("-inf")).argmax()


@pytest.mark.parametrize("backend", [*BACKENDS, *TRITON_VARIANTS[1:]])
def test_greedy_takes_the_lowest_allowed_id_among_equal_maxima(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    how = use(backend, monkeypatch)
    x = torch.zeros(4, 100)
    x[:, [10, 20, 30, 70]] = 5.0  # tied maxima
    x[:, 90] = 9.0
    allowed = torch.ones(4, 100, dtype=torch.bool)
    allowed[:, 90] = False  # the largest is out: the tie decides
    allowed[1, 10] = False
    allowed[2, [10, 20, 30]] = False
    allowed[3, [10, 20, 30, 70]] = False  # then zeros tie: the first allowed zero, 0
    rows = [SamplingRow(temperature=0.0), SamplingRow(top_k=1)] * 2
    tokens = run(x, rows, pack(allowed), how).token_ids
    assert tokens.tolist() == [10, 20, 70, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mask_that_disallows_only_a_first_or_last_token_is_applied(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C sampler reads a row that allows every token as if it had no mask: a row
    differing only in its first or its last (partial) word is not one of them."""
    how = use(backend, monkeypatch)
    v = 1000
    x = torch.arange(v, dtype=torch.float32).repeat(3, 1)
    x[1, 0] = 2000.0
    allowed = torch.ones(3, v, dtype=torch.bool)
    allowed[0, v - 1] = False
    allowed[1, 0] = False
    rows = [SamplingRow(temperature=0.0), SamplingRow(temperature=0.0), SamplingRow(top_k=1)]
    assert run(x, rows, pack(allowed), how).token_ids.tolist() == [v - 2, v - 1, v - 1]


@pytest.mark.parametrize("backend", [*BACKENDS, *TRITON_VARIANTS[1:]])
def test_a_row_allowing_one_token_always_samples_it(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    how = use(backend, monkeypatch)
    v = 70
    rows = ROW_KINDS
    x = torch.randn(len(rows), v) * 4
    # the allowed token is the row's smallest logit: every filter would cut it unmasked
    only = x.argmin(dim=1)
    allowed = torch.zeros(len(rows), v, dtype=torch.bool)
    allowed[torch.arange(len(rows)), only] = True
    out = run(x, rows, pack(allowed), how)
    assert out.token_ids.tolist() == only.tolist()


# --- the filters see only allowed tokens --------------------------------------------------

DRAWS = 20_000
# The reference loops over rows in Python, and one interpreted launch of 3,000 rows over 64
# tokens takes about a second.
SLOW_DRAWS = 3_000
# (vocab, row): the mask (below) removes the largest logits, so each filter's cut differs
# from the unmasked row's.
CASES: dict[str, tuple[int, SamplingRow]] = {
    "T=0.8": (64, SamplingRow(temperature=0.8)),
    "top_k=4": (64, SamplingRow(top_k=4)),
    "top_p=0.5": (64, SamplingRow(top_p=0.5)),
    "min_p=0.25": (64, SamplingRow(min_p=0.25)),
    "all filters, penalties": (
        64,
        SamplingRow(
            temperature=1.2,
            top_k=12,
            top_p=0.8,
            min_p=0.02,
            presence_penalty=0.8,
            repetition_penalty=1.3,
            prompt_token_ids=(3, 4),
            output_token_ids=(5, 6, 6),
        ),
    ),
}
# The kernel's default tiles take each kind of row (top_p alone, min_p alone by rejection,
# everything); the variants those that reach their passes.
TRITON_CASES = [
    ("triton", "top_p=0.5"),
    ("triton", "min_p=0.25"),
    ("triton", "all filters, penalties"),
    ("triton-narrow", "all filters, penalties"),
    ("triton-no-slots", "all filters, penalties"),
    ("triton-one-slot", "top_p=0.5"),
    ("triton-one-slot", "all filters, penalties"),
]


def masked_case(name: str) -> tuple[torch.Tensor, SamplingRow, torch.Tensor]:
    v, row = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randn(v, generator=g) * 1.5
    allowed = torch.rand(v, generator=g) < 0.6
    allowed[x.topk(3).indices] = False  # the three largest are out
    return x, row, allowed


def check_distribution(name: str, how: tuple[str, Any], draws: int) -> None:
    x, row, allowed = masked_case(name)
    mask = pack(allowed[None]).expand(draws, -1)
    tokens = run(x[None].expand(draws, -1), [row] * draws, mask, how).token_ids
    counts = torch.bincount(tokens, minlength=x.numel())
    probs = reference_probs(x, row, allowed)
    assert probs[~allowed].sum() == 0
    p = chi_square_p(counts, probs)  # also: no count outside the support
    assert p > 1e-3, f"{name}: chi-square p = {p:.2e}"


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", ["c", "torch"])
def test_sampling_under_a_mask_draws_the_masked_distribution(
    backend: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_distribution(name, use(backend, monkeypatch), DRAWS)


def test_the_reference_under_a_mask_draws_its_own_masked_distribution() -> None:
    check_distribution("all filters, penalties", ("reference", torch.device("cpu")), SLOW_DRAWS)


@pytest.mark.parametrize("name", ["top_p=0.5", "all filters, penalties"])
def test_rows_the_c_sampler_leaves_are_finished_under_the_mask(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a single uniform per row, every top_p rejection in C leaves the row to the torch
    code, which must apply the same rows of the mask."""
    monkeypatch.setattr(sampling_torch, "_NATIVE_DRAWS", 1)
    check_distribution(name, use("c", monkeypatch), DRAWS)


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "name"), TRITON_CASES)
def test_the_triton_kernel_under_a_mask_draws_the_masked_distribution(
    backend: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_distribution(name, use(backend, monkeypatch), SLOW_DRAWS)


# --- an all-ones mask changes nothing -----------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_all_ones_mask_gives_the_tokens_of_no_mask(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    how = use(backend, monkeypatch)
    v = 1000  # 31.25 words: the last word's bits past V are left clear in some rows
    rows = [replace(r, seed=100 + i, offset=i) for i, r in enumerate(ROW_KINDS * 2)]
    x = torch.randn(len(rows), v) * 2
    mask = torch.full((len(rows), (v + 31) // 32), -1, dtype=torch.int32)
    mask[::2, -1] = 0xFF  # exactly the 8 tokens of the last word
    plain = run(x, rows, None, how)
    masked = run(x, rows, mask, how)
    assert masked.token_ids.tolist() == plain.token_ids.tolist()
    torch.testing.assert_close(masked.logprobs, plain.logprobs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_seeded_masked_row_gives_the_same_token_alone_and_in_a_batch(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    how = use(backend, monkeypatch)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 300, generator=g)
    mask = pack(random_allowed(8, 300, 0.3, g))
    rows = [SamplingRow(top_p=0.8, min_p=0.02, seed=21, offset=i) for i in range(8)]
    batch = run(x, rows, mask, how).token_ids.tolist()
    alone = [
        int(run(x[i : i + 1], rows[i : i + 1], mask[i : i + 1], how).token_ids[0]) for i in (1, 6)
    ]
    assert alone == [batch[1], batch[6]]


# --- logprobs -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_stay_the_raw_unmasked_ones(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    how = use(backend, monkeypatch)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(len(ROW_KINDS), 200, generator=g) * 2
    allowed = random_allowed(len(ROW_KINDS), 200, 0.2, g)
    allowed[torch.arange(len(ROW_KINDS)), x.argmax(dim=1)] = False
    rows = [replace(r, num_logprobs=4) for r in ROW_KINDS]
    out = run(x, rows, pack(allowed), how)
    raw = torch.log_softmax(x, dim=1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    values, ids = out.top_logprobs
    top = raw.topk(4, dim=1)
    assert torch.equal(ids, top.indices)  # the largest is disallowed, and still reported
    torch.testing.assert_close(values, top.values)


# --- rows and masks that are refused ------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_with_nothing_allowed_and_finite_raises_naming_only_that_row(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    how = use(backend, monkeypatch)
    rows = ROW_KINDS[:6]
    x = torch.randn(len(rows), 50)
    x[2, :10] = float("-inf")
    allowed = torch.ones(len(rows), 50, dtype=torch.bool)
    allowed[2, 10:] = False  # allows only -inf logits
    allowed[4] = False  # allows nothing
    with pytest.raises(NonFiniteLogitsError) as info:
        run(x, rows, pack(allowed), how)
    assert info.value.rows == (2, 4)
    # a NaN at a disallowed token is still a fault upstream: the raw logprobs would be NaN
    allowed[[2, 4]] = True
    x[2], x[3, 7] = 0.0, float("nan")
    allowed[3, 7] = False
    with pytest.raises(NonFiniteLogitsError) as info:
        run(x, rows, pack(allowed), how)
    assert info.value.rows == (3,)


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (torch.full((2, 2), -1, dtype=torch.int64), "int32"),
        (torch.full((2, 2), True), "int32"),
        (torch.full((4,), -1, dtype=torch.int32), r"\[2 rows, 2 words\]"),
        (torch.full((2, 3), -1, dtype=torch.int32), r"\[2 rows, 2 words\] for 40 tokens"),
        (torch.full((2, 1), -1, dtype=torch.int32), r"got \(2, 1\)"),
        (torch.full((3, 2), -1, dtype=torch.int32), r"got \(3, 2\)"),
        ([[-1, -1], [-1, -1]], "torch.Tensor"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
def test_a_malformed_mask_is_a_value_error(backend: str, mask: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sample(torch.zeros(2, 40), [SamplingRow()] * 2, backend=backend, token_bitmask=mask)


def test_the_c_wrapper_checks_the_mask_it_is_given() -> None:
    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("the C kernels do not build here")
    x = torch.zeros(2, 40)
    ones = torch.ones(2)
    args = (x, ones, torch.zeros(2, dtype=torch.int64), ones, ones * 0, torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"mask must be a \[2, 2\] int32"):
        ops.sample(*args, mask=torch.full((2, 3), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        ops.sample(*args, mask=torch.full((2, 4), -1, dtype=torch.int32)[:, ::2])
    tokens, _, left = ops.sample(*args, mask=torch.tensor([[0, 4], [-1, 0]]).int())
    assert tokens.tolist() == [34, 0] and left == 0


# --- penalties come before the mask -------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_mask_applies_to_the_penalized_logits(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    how = use(backend, monkeypatch)
    x = torch.tensor([[5.0, 4.0, 3.0, 1.0]] * 2)
    allowed = torch.tensor([[True, True, False, True]] * 2)
    # a presence penalty pushes token 0 below 1; the mask leaves token 2 out either way
    rows = [
        SamplingRow(temperature=0.0, presence_penalty=3.0, output_token_ids=(0,)),
        SamplingRow(temperature=0.0, presence_penalty=3.0, output_token_ids=(0, 1)),
    ]
    tokens = run(x, rows, pack(allowed), how).token_ids.tolist()
    expected = [
        int(torch.where(allowed[i], penalize(x[i], rows[i]), float("-inf")).argmax())
        for i in range(2)
    ]
    assert tokens == expected == [1, 0]
