"""The torch path (the CPU's, and any device's without Triton) against the sort-based
reference: greedy rows, the distribution every filter leaves, penalties, logprobs, seeds and
input checks."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from hotpool.kernels import sampling_torch, sampling_transfer
from hotpool.kernels.sampling import SamplingRow, sample
from hotpool.kernels.sampling_reference import reference_probs

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def frequencies(logits: torch.Tensor, row: SamplingRow, draws: int, device: str = "cpu"):
    """How often each token comes out of ``draws`` identical rows, in batches of 2,000."""
    counts = torch.zeros(logits.numel(), dtype=torch.float64)
    for start in range(0, draws, 2000):
        n = min(2000, draws - start)
        batch = logits.to(device)[None].expand(n, -1)
        tokens = sample(batch, [row] * n, backend="torch").token_ids
        counts += torch.bincount(tokens, minlength=logits.numel()).double()
    return counts / draws


def assert_matches(freq: torch.Tensor, probs: torch.Tensor, draws: int) -> None:
    """Never a token the reference excludes; each frequency within 5 sigma of its p."""
    assert freq[probs == 0].sum() == 0, "drew a token the filters removed"
    sigma = (probs * (1 - probs) / draws).sqrt()
    worst = ((freq - probs).abs() / (sigma + 1e-9)).max()
    assert worst < 5, f"frequency off by {worst:.1f} sigma\n{freq}\n{probs}"


@pytest.fixture(autouse=True)
def fixed_seed() -> None:
    torch.manual_seed(1234)  # unseeded rows draw from the default generator


@pytest.fixture(params=["native", "rejection", "sorted"])
def nucleus_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU's C sampler (one call for the batch); the torch code's rejection top-p; or
    the full sort other devices use for top-p rows without top_k."""
    if request.param != "native":
        monkeypatch.setattr(sampling_torch, "_sample_native", _torch_only)
    if request.param == "sorted":
        monkeypatch.setattr(sampling_torch, "_REJECTION_DEVICES", ())
    return str(request.param)


def _torch_only(
    native: object,
    x: torch.Tensor,
    rows: list[SamplingRow],
    gens: list[torch.Generator | None],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    return sampling_torch.sample_penalized(x, rows, gens, mask)


# --- greedy ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_are_the_argmax_whatever_their_filters(device: str) -> None:
    logits = torch.randn(64, 300, device=device)
    rows = [SamplingRow(temperature=0.0, top_k=i % 5, top_p=0.1 + i / 80) for i in range(64)]
    out = sample(logits, rows, backend="torch")
    assert out.token_ids.device.type == "cpu"
    assert out.token_ids.dtype == torch.long
    assert out.token_ids.tolist() == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize("vocab", [5, 300, 49152, 50257])
def test_greedy_takes_the_first_of_tied_maxima(vocab: int) -> None:
    logits = torch.zeros(4, vocab)
    logits[0, [1, vocab - 1]] = 1.0  # tied, the second one in the last (short) block
    logits[1, vocab - 1] = 1.0  # alone at the very end
    logits[2, [vocab // 2, vocab // 2 + 1]] = 1.0  # tied inside one block
    logits[3] = 7.0  # all tied
    rows = [SamplingRow(temperature=0.0)] * 4
    assert sample(logits, rows).token_ids.tolist() == [1, vocab - 1, vocab // 2, 0]


def test_temperatures_too_small_to_divide_by_are_greedy() -> None:
    logits = torch.randn(8, 1000) * 100
    rows = [SamplingRow(temperature=1e-7, top_p=0.9)] * 8
    assert sample(logits, rows).token_ids.tolist() == logits.argmax(dim=1).tolist()


def test_top_k_1_is_greedy_even_when_hot() -> None:
    logits = torch.randn(8, 1000)
    rows = [SamplingRow(temperature=2.0, top_k=1, generator=gen(i)) for i in range(8)]
    assert sample(logits, rows).token_ids.tolist() == logits.argmax(dim=1).tolist()


def test_tiny_top_p_is_greedy(nucleus_path: str) -> None:
    logits = torch.randn(8, 1000)
    rows = [SamplingRow(temperature=1.5, top_p=1e-6, generator=gen(i)) for i in range(8)]
    assert sample(logits, rows).token_ids.tolist() == logits.argmax(dim=1).tolist()


def test_greedy_and_sampled_rows_mix_in_one_batch() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 7.0]])
    rows = [
        SamplingRow(temperature=0.0),
        SamplingRow(top_k=1, generator=gen(0)),
        SamplingRow(temperature=0.7, top_p=0.01, generator=gen(0)),
    ]
    assert sample(logits, rows).token_ids.tolist() == [2, 0, 3]


# --- the distribution each filter leaves -------------------------------------------------

SMALL = torch.tensor([2.0, 1.6, 1.1, 0.9, 0.3, -0.4, -1.0, -2.5])  # distinct probabilities
CASES = {
    "plain": SamplingRow(),
    "hot": SamplingRow(temperature=2.0),
    "cold": SamplingRow(temperature=0.5),
    "top_k=3": SamplingRow(top_k=3),
    "top_k>V": SamplingRow(top_k=10),
    "top_p=0.6": SamplingRow(top_p=0.6),
    "top_p=0.9,T=0.7": SamplingRow(temperature=0.7, top_p=0.9),
    "min_p=0.15": SamplingRow(min_p=0.15),
    "top_k=5,top_p=0.7": SamplingRow(top_k=5, top_p=0.7),
    "all filters": SamplingRow(temperature=1.3, min_p=0.05, top_k=6, top_p=0.8),
    "min_p,top_p": SamplingRow(temperature=0.8, min_p=0.1, top_p=0.75),
    "penalties": SamplingRow(
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.4,
        prompt_token_ids=(0, 5),
        output_token_ids=(1, 1, 2, 6),
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row", CASES.values(), ids=CASES.keys())
def test_small_vocab_distribution_matches_the_reference(
    row: SamplingRow, nucleus_path: str, device: str
) -> None:
    draws = 20_000
    freq = frequencies(SMALL, row, draws, device)
    assert_matches(freq, reference_probs(SMALL, row), draws)


def test_top_p_applies_to_the_top_k_survivors() -> None:
    # top_k=2 leaves [0.4, 0.3] -> renormalised [4/7, 3/7]; 4/7 already exceeds top_p=0.55,
    # so only token 0 is left. Top-p over the full row first (0.4 < 0.55) would keep token 1.
    logits = torch.tensor([math.log(p) for p in (0.4, 0.3, 0.2, 0.1)])
    assert frequencies(logits, SamplingRow(top_k=2, top_p=0.55), 2000)[0] == 1.0


def rank_buckets(probs: torch.Tensor, n: int = 10) -> torch.Tensor:
    """Bucket of each token: tokens by descending probability, cut into ``n`` equal masses."""
    sorted_probs, order = probs.sort(descending=True)
    bucket = torch.empty_like(order)
    bucket[order] = (sorted_probs.cumsum(0) - sorted_probs).mul(n).long().clamp(max=n - 1)
    return bucket


LARGE = {
    # a flat row: the nucleus holds thousands of tokens
    "flat,top_p=0.9": (0.5, SamplingRow(top_p=0.9)),
    # a small nucleus out of a flat row: many rejection rounds, some rows end in a sort
    "flat,top_p=0.03": (0.5, SamplingRow(top_p=0.03)),
    # a peaked row, as language models give: a nucleus of a few dozen tokens
    "peaked,top_p=0.9": (3.0, SamplingRow(temperature=0.7, top_p=0.9)),
    "flat,min_p=0.3": (0.5, SamplingRow(min_p=0.3)),
    "top_k=300,top_p=0.8": (1.0, SamplingRow(top_k=300, top_p=0.8)),
    "top_k=3": (1.0, SamplingRow(top_k=3, temperature=2.0)),
    "min_p,top_p": (1.0, SamplingRow(temperature=1.2, min_p=0.02, top_p=0.95)),
}


def assert_large_vocab_matches(scale: float, row: SamplingRow) -> None:
    """Over 2,000 tokens, the frequency of each tenth of the reference's mass (by rank)."""
    logits = torch.randn(2000, generator=gen(7)) * scale
    probs = reference_probs(logits, row)
    draws = 8000
    freq = frequencies(logits, row, draws)
    assert freq[probs == 0].sum() == 0, "drew a token the filters removed"
    buckets = rank_buckets(probs)
    assert_matches(
        torch.zeros(10, dtype=torch.float64).index_add_(0, buckets, freq),
        torch.zeros(10, dtype=torch.float64).index_add_(0, buckets, probs),
        draws,
    )


@pytest.mark.parametrize(("scale", "row"), LARGE.values(), ids=LARGE.keys())
def test_large_vocab_distribution_matches_the_reference(
    scale: float, row: SamplingRow, nucleus_path: str
) -> None:
    assert_large_vocab_matches(scale, row)


@pytest.mark.parametrize(
    ("knob", "value"),
    [("_MAX_REJECTION_ROUNDS", 0), ("_MAX_REJECTION_ROUNDS", 100),
     ("_NATIVE_DRAWS", 1), ("_NATIVE_DRAWS", 16)],
    ids=["torch: sort at once", "torch: reject until done",
         "C: torch finishes each rejection", "C: rejections"],
)  # fmt: skip
@pytest.mark.parametrize("case", ["flat,top_p=0.9", "flat,top_p=0.03", "top_k=300,top_p=0.8"])
def test_rejection_rounds_do_not_change_the_distribution(
    knob: str, value: int, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The torch code's rounds (the C call left out), or the C call's uniforms: with one, every
    # rejected draw leaves the row to the torch code; with sixteen the C call redraws among
    # the heavier tokens itself, round after round.
    monkeypatch.setattr(sampling_torch, knob, value)
    if knob == "_MAX_REJECTION_ROUNDS":
        monkeypatch.setattr(sampling_torch, "_sample_native", _torch_only)
    assert_large_vocab_matches(*LARGE[case])


@pytest.mark.parametrize("draw", [0.0, 1 - 2**-24], ids=["lowest", "highest"])
@pytest.mark.parametrize(
    "row", [SamplingRow(top_p=0.9), SamplingRow(top_k=3000, top_p=0.9)], ids=["full", "top_k"]
)
def test_extreme_uniform_draws_stay_inside_the_nucleus(
    monkeypatch: pytest.MonkeyPatch, draw: float, row: SamplingRow, nucleus_path: str
) -> None:
    # Over a long row the sums round differently by an ulp or two; a draw just under 1 must
    # still land on a token top-p kept, never on one it cut.
    monkeypatch.setattr(sampling_torch, "uniforms", lambda gens: [draw] * len(gens))
    monkeypatch.setattr(sampling_torch, "uniform_draws", lambda gens, n: [draw] * sum(n))
    logits = torch.randn(20, 4096) * 3
    tokens = sample(logits, [row] * 20).token_ids
    for i in range(20):
        probs = reference_probs(logits[i], row)
        assert probs[tokens[i]] > 0, f"row {i}: token {tokens[i]} is outside the top-p set"
        sorted_path = nucleus_path == "sorted" or (row.top_k and nucleus_path == "rejection")
        if draw == 0.0 and sorted_path:  # sorted candidates: the lowest draw is the largest
            assert tokens[i] == logits[i].argmax()


def test_random_mixed_batches_only_draw_tokens_the_reference_keeps(nucleus_path: str) -> None:
    """Every kind of row in one batch, each token checked against its own row's filters."""
    g = gen(11)
    for _ in range(5):
        logits = torch.randn(64, 3000, generator=g) * float(torch.empty(()).uniform_(0.3, 6))
        rows = []
        for _ in range(64):
            r = torch.rand(6, generator=g).tolist()
            rows.append(
                SamplingRow(
                    temperature=0.0 if r[0] < 0.15 else 0.2 + 2 * r[0],
                    top_k=[0, 0, 1, 5, 50, 2999, 5000][int(r[1] * 7)],
                    top_p=1.0 if r[2] < 0.3 else 0.01 + r[2] * 0.99,
                    min_p=0.0 if r[3] < 0.5 else r[3] - 0.5,
                    presence_penalty=0.0 if r[4] < 0.5 else 1.0,
                    output_token_ids=tuple(range(0, 3000, 97)),
                    generator=gen(int(r[5] * 1000)) if r[5] < 0.5 else None,
                )
            )
        tokens = sample(logits, rows).token_ids
        for i, row in enumerate(rows):
            assert reference_probs(logits[i], row)[tokens[i]] > 0, f"row {i}: {row}"


def test_masked_tokens_are_never_drawn(nucleus_path: str) -> None:
    logits = torch.randn(6, 512)
    logits[:, ::2] = float("-inf")
    rows = [
        SamplingRow(),
        SamplingRow(top_p=0.95),
        SamplingRow(top_k=400),
        SamplingRow(min_p=0.01),
        SamplingRow(temperature=5.0, top_p=0.99),
        SamplingRow(top_k=300, top_p=0.5),
    ]
    for _ in range(20):
        assert all(t % 2 == 1 for t in sample(logits, rows).token_ids.tolist())


# --- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_the_raw_logits_log_softmax_at_the_sampled_tokens() -> None:
    logits = torch.randn(6, 1000) * 2
    rows = [
        SamplingRow(temperature=0.0),
        SamplingRow(temperature=0.3, top_p=0.8),
        SamplingRow(temperature=1.7, top_k=40, presence_penalty=2.0, output_token_ids=(1, 2)),
        SamplingRow(repetition_penalty=2.0, prompt_token_ids=tuple(range(100))),
        SamplingRow(min_p=0.2, generator=gen(1)),
        SamplingRow(temperature=0.0, frequency_penalty=3.0, output_token_ids=(5,) * 4),
    ]
    out = sample(logits, rows)
    expected = torch.log_softmax(logits, dim=1).gather(1, out.token_ids[:, None]).squeeze(1)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, expected)
    assert out.top_logprobs is None


@pytest.mark.parametrize("vocab", [700, 49152 + 37])
def test_top_logprobs_are_the_largest_raw_logprobs_sorted(vocab: int) -> None:
    logits = torch.randn(5, vocab)
    rows = [SamplingRow(num_logprobs=n, temperature=0.5) for n in (0, 3, 20, 1, 0)]
    out = sample(logits, rows)
    assert out.top_logprobs is not None
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (5, 20)
    assert values.dtype == torch.float32 and ids.dtype == torch.long
    assert torch.all(values[:, :-1] >= values[:, 1:])
    expected_values, expected_ids = torch.topk(torch.log_softmax(logits, dim=1), 20)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(values, expected_values)


def test_top_logprobs_stop_at_the_vocabulary() -> None:
    out = sample(torch.randn(2, 4), [SamplingRow(num_logprobs=20)] * 2)
    assert out.top_logprobs is not None and out.top_logprobs[0].shape == (2, 4)


def test_bf16_logits_are_sampled_in_float32() -> None:
    logits = torch.randn(4, 300).bfloat16()
    out = sample(logits, [SamplingRow(temperature=0.0), SamplingRow(top_p=0.9)] * 2)
    assert out.token_ids[::2].tolist() == logits.float()[::2].argmax(dim=1).tolist()
    expected = torch.log_softmax(logits.float(), dim=1).gather(1, out.token_ids[:, None])
    torch.testing.assert_close(out.logprobs, expected.squeeze(1))


def test_results_pack_into_one_host_copy_and_back() -> None:
    """What a GPU call copies to the host in one go: float32s travel by their bits."""
    tokens = torch.tensor([3, 49151])
    logprobs = torch.tensor([-0.0, -123.456])
    top = (torch.tensor([[-1e-30, float("-inf")], [-2.5, -7.0]]), torch.tensor([[1, 2], [3, 4]]))
    out = sampling_transfer.unpack(sampling_transfer.pack(tokens, logprobs, top), 2)
    assert torch.equal(out.token_ids, tokens)
    assert torch.equal(out.logprobs.view(torch.int32), logprobs.view(torch.int32))
    assert out.top_logprobs is not None
    assert torch.equal(out.top_logprobs[0], top[0]) and torch.equal(out.top_logprobs[1], top[1])
    packed = sampling_transfer.pack(tokens, logprobs, None)
    assert sampling_transfer.unpack(packed, 0).top_logprobs is None


def test_with_offset_is_the_same_row_at_another_offset() -> None:
    g = torch.Generator().manual_seed(3)
    row = SamplingRow(temperature=0.7, top_k=5, seed=9, offset=2, generator=g, num_logprobs=3)
    later = row.with_offset(40)
    assert later == SamplingRow(
        temperature=0.7, top_k=5, seed=9, offset=40, generator=g, num_logprobs=3
    )
    assert row.offset == 2 and later.generator is g  # a copy; the generator is shared
    with pytest.raises(ValueError, match="offset"):
        row.with_offset(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", [1, 3, 4, 6])
def test_kernel_params_carry_every_row_in_one_aligned_buffer(device: str, b: int) -> None:
    rows = [
        SamplingRow(
            temperature=0.5 + i,
            top_k=[0, 7, 2**40][i % 3],
            top_p=0.25 * (i % 4 + 1),
            min_p=0.01 * i,
            seed=[2**64 - 1, -(2**63), 123][i % 3],
            offset=10 * i,
        )
        for i in range(b)
    ]
    k = sampling_transfer.kernel_params(rows, torch.device(device))
    expect = {
        "temperature": (torch.float32, [r.temperature for r in rows]),
        "top_k": (torch.int32, [min(r.top_k, 2**31 - 1) for r in rows]),
        "top_p": (torch.float32, [r.top_p for r in rows]),
        "min_p": (torch.float32, [r.min_p for r in rows]),
        "seeds": (torch.int64, [-1, -(2**63), 123, -1, -(2**63), 123][:b]),
        "offsets": (torch.int64, [r.offset for r in rows]),
    }
    bases = set()
    for name, (dtype, values) in expect.items():
        t = getattr(k, name)
        assert t.dtype == dtype and t.device.type == device and t.is_contiguous(), name
        assert torch.equal(t.cpu(), torch.tensor(values, dtype=dtype)), name
        assert t.data_ptr() % 16 == 0, name  # one compiled kernel variant, whatever B is
        bases.add(t.untyped_storage().data_ptr())
    assert len(bases) == 1  # one buffer, so one host-to-device copy


# --- seeds ---------------------------------------------------------------------------------

SEEDED = {
    "plain": SamplingRow(temperature=0.9),
    "top_p": SamplingRow(top_p=0.7),
    "top_k": SamplingRow(top_k=20, top_p=0.9),
    "min_p": SamplingRow(min_p=0.05, frequency_penalty=0.5, output_token_ids=(1, 2, 3)),
}


@pytest.mark.parametrize("row", SEEDED.values(), ids=SEEDED.keys())
def test_a_seeded_row_gives_the_same_tokens_alone_and_inside_a_batch(
    row: SamplingRow, nucleus_path: str
) -> None:
    logits = torch.randn(16, 1024) * 0.7
    others = [
        SamplingRow(),
        SamplingRow(temperature=0.0),
        SamplingRow(top_k=500, generator=gen(9)),
        SamplingRow(top_p=0.3),
        SamplingRow(top_p=0.95, min_p=0.1, generator=gen(8)),
        SamplingRow(top_k=3, presence_penalty=1.0, output_token_ids=(4,)),
    ]
    alone, together = gen(42), gen(42)
    for _ in range(10):
        mine = sample(logits[7:8], [replace(row, generator=alone)]).token_ids[0]
        rows = [others[i % len(others)] for i in range(16)]
        rows[7] = replace(row, generator=together)
        assert sample(logits, rows).token_ids[7] == mine


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: twenty seeds agreeing is ~1e-57
    firsts = {int(sample(logits, [SamplingRow(generator=gen(s))]).token_ids[0]) for s in range(20)}
    assert len(firsts) > 1


# --- input checks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "rows"),
    [((2, 10), 3), ((3, 10), 2), ((10,), 1), ((1, 2, 10), 1), ((0, 10), 1), ((1, 0), 1)],
)
def test_shape_mismatch_raises(shape: tuple[int, ...], rows: int) -> None:
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(shape), [SamplingRow()] * rows)


def test_integer_logits_raise() -> None:
    with pytest.raises(ValueError, match="floating"):
        sample(torch.zeros(1, 4, dtype=torch.long), [SamplingRow()])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"num_logprobs": -1},
        {"presence_penalty": math.inf},
        {"frequency_penalty": math.nan},
    ],
    ids=str,
)
def test_nonsense_parameters_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingRow(**kwargs)  # type: ignore[arg-type]


def test_an_empty_batch_gives_empty_results() -> None:
    out = sample(torch.zeros(0, 10), [])
    assert out.token_ids.shape == (0,) and out.logprobs.shape == (0,)
