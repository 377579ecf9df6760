"""The Triton sampler's wrapper and kernel: greedy rows, logprobs, seeds, long rows, extreme
magnitudes, low-precision logits, rows with nothing to sample, input checks.

Without a GPU the kernel runs in Triton's CPU interpreter (``tests/kernels/conftest.py`` sets
``TRITON_INTERPRET`` before triton is imported); with one, on CUDA. The exact distribution
is tested in ``test_sampling_distribution.py``, awkward rows by fuzzing in
``test_sampling_fuzz.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from hotpool.kernels.sampling import SamplingRow
from hotpool.kernels.sampling_reference import reference_probs
from hotpool.kernels.triton_sampling import kernel_device, triton_sample

# In Triton's interpreter tile ops run in numpy, which warns about overflow or NaN in lanes
# the kernel then masks out (rows with +inf, logits near float32's limits).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

DEVICE = kernel_device()
# Rows per program: the wrapper's choice (hundreds of rows in the interpreter), or one, a
# GPU's choice for long rows, which the interpreter would otherwise never run.
TILING = pytest.mark.parametrize("tiling", [None, 1], ids=["auto tiles", "one row"])


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
        torch.full((b,), temperature, dtype=torch.float32, device=DEVICE),
        torch.full((b,), top_k, dtype=torch.int32, device=DEVICE),
        torch.full((b,), top_p, dtype=torch.float32, device=DEVICE),
        torch.full((b,), min_p, dtype=torch.float32, device=DEVICE),
        torch.full((b,), seed, dtype=torch.int64, device=DEVICE),
        torch.arange(b, device=DEVICE) if offsets is None else offsets.to(DEVICE),
    )


def run(x: torch.Tensor, *p: torch.Tensor, tiling: int | None = None) -> tuple[list[int], Any]:
    tokens, logprobs = triton_sample(x.to(DEVICE), *p, rows_per_program=tiling)
    return tokens.tolist(), logprobs.cpu()


def draws(row: torch.Tensor, n: int, **kw: Any) -> torch.Tensor:
    """``n`` draws from one row: ``n`` copies in one launch, one offset each."""
    tokens, _ = run(row.expand(n, -1), *params(n, **kw))
    return torch.tensor(tokens)


@TILING
def test_greedy_rows_take_the_first_argmax(tiling: int | None) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 257)
    x[3, 10] = x[3, 200] = 50.0  # a tie: the lowest index wins
    temperature, top_k, *rest = params(6, temperature=0.0, top_p=0.5)
    top_k[5], temperature[5] = 1, 0.7  # top_k == 1 is greedy whatever the temperature
    tokens, _ = run(x, temperature, top_k, *rest, tiling=tiling)
    assert tokens == x.argmax(dim=1).tolist()
    assert tokens[3] == 10


@TILING
def test_logprobs_are_raw_log_softmax_at_the_sampled_token(tiling: int | None) -> None:
    torch.manual_seed(1)
    x = torch.randn(8, 130) * 4
    temperature, top_k, top_p, min_p, seeds, offsets = params(8)
    temperature[:2] = 0.0
    temperature[2:] = torch.tensor([0.5, 2.0, 1.0, 0.7, 1.3, 0.9])
    top_k[4], top_p[5], min_p[6] = 7, 0.8, 0.1
    tokens, logprobs = run(x, temperature, top_k, top_p, min_p, seeds, offsets, tiling=tiling)
    expected = torch.log_softmax(x, dim=1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)


@TILING
def test_a_seed_and_offset_give_the_same_token_wherever_the_row_sits(tiling: int | None) -> None:
    torch.manual_seed(2)
    x = torch.randn(6, 90)
    p = params(6, temperature=1.5, offsets=torch.tensor([5, 9, 11, 3, 0, 7]))
    p[1][3] = 10  # a top_k row: the draw is a function of (seed, offset) there too
    p[2][4] = 0.7  # a top_p row
    first, _ = run(x, *p, tiling=tiling)
    perm = [4, 2, 0, 5, 1, 3, 2]  # shuffled, in a batch of another size
    again, _ = run(x[perm], *(t[perm] for t in p), tiling=tiling)
    assert again == [first[i] for i in perm]
    # One row with many offsets: different offsets give different draws.
    assert len(set(draws(torch.zeros(90), 40).tolist())) > 15


def test_the_tiling_does_not_change_any_token() -> None:
    torch.manual_seed(3)
    x = torch.randn(13, 200) * 2
    p = params(13, temperature=0.9)
    p[1][::3], p[2][1::3], p[3][2::3] = 12, 0.8, 0.05
    # A GPU compiles each tiling, and a [64, 256] tile takes it a minute.
    tilings = (1, 4, 64) if DEVICE.type == "cpu" else (1, 2, 4)
    tokens = [run(x, *p, tiling=t)[0] for t in tilings]
    assert tokens[0] == tokens[1] == tokens[2]


def test_any_tile_width_gives_valid_draws_and_the_same_greedy_tokens() -> None:
    """The tile width (the CPU and a GPU choose different ones) decides which lane a draw's
    first uniform lands in, so a seeded draw may differ between widths; greedy tokens and
    every logprob may not. The distribution at a narrow width is checked in
    test_sampling_distribution.py."""
    torch.manual_seed(4)
    x = torch.randn(6, 600) * 3
    p = params(6, temperature=0.8)
    p[0][::3] = 0.0  # greedy rows
    p[1][1::3], p[2][1::3] = 40, 0.9
    expected = torch.log_softmax(x, dim=1)
    outs = [run(x, *p, tiling=None) for _ in range(1)]
    for w in (16, 64, 1024, 4096):
        tokens, logprobs = triton_sample(x.to(DEVICE), *p, block=w)
        tokens = tokens.tolist()
        assert tokens[::3] == outs[0][0][::3] == x[::3].argmax(dim=1).tolist()
        for r in (1, 4):  # top_k=40 and top_p=0.9: inside the top 40
            assert tokens[r] in x[r].topk(40).indices.tolist()
        got = logprobs.cpu()
        want = expected.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block must be a power of two"):
        triton_sample(x.to(DEVICE), *p, block=8)


def test_loading_ahead_changes_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PREFETCH`` (the next tile's loads issued before this one is worked on) only moves
    loads earlier."""
    from hotpool.kernels import triton_sampling

    torch.manual_seed(6)
    x = torch.randn(6, 2500) * 3
    x[2, 2400] = 9.0  # the max in the short last tile
    p = params(6, temperature=0.8)
    p[0][::3] = 0.0
    p[1][1::3], p[2][2::3] = 40, 0.9
    before = triton_sample(x.to(DEVICE), *p)
    monkeypatch.setattr(triton_sampling, "_CPU_PREFETCH", True)
    monkeypatch.setattr(triton_sampling, "GPU_PREFETCH", not triton_sampling.GPU_PREFETCH)
    after = triton_sample(x.to(DEVICE), *p)
    assert after[0].tolist() == before[0].tolist()
    torch.testing.assert_close(after[1], before[1])


def mixed_rows(b: int, v: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Rows from flat to peaked, some masked to -inf, some with ties, and every combination
    of temperature, top_k, top_p and min_p that searches for a threshold."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(b, v, generator=g) * torch.linspace(0.2, 8.0, b)[:, None]
    x[::7, ::3] = float("-inf")  # a grammar's mask
    x[5::11, : v // 3] = 2.5  # a third of the row tied, near the top
    p = params(b)
    combos = [
        (t, k, tp, mp)
        for t in (0.3, 1.0, 2.5)
        for k in (0, 3, 50, v // 2)
        for tp in (1.0, 0.5, 0.9, 0.995)
        for mp in (0.0, 0.01, 0.3)
        if k or tp < 1.0
    ]
    for row in range(b):
        t, k, tp, mp = combos[(row * 7) % len(combos)]
        p[0][row], p[1][row], p[2][row], p[3][row] = t, k, tp, mp
    return x.to(DEVICE), p


@pytest.mark.parametrize("block", [16, 256])
def test_searching_the_candidates_or_the_whole_row_draws_the_same_tokens(block: int) -> None:
    """A top_k or top_p row is searched over its candidates, the logits at or above a cut
    from the first pass (``sampling_candidates``), unless a lane holds more than its slots;
    with no slots every row is searched over the whole row. A cut above a kept token would
    move the threshold and so the draw; with one slot some rows overflow and some do not,
    in one program. 16 lanes over 700 tokens: 44 per lane, 16 slots, flat rows overflow;
    256 lanes: 3 per lane, 3 slots, none can."""
    x, p = mixed_rows(96, 700)
    base = triton_sample(x, *p, block=block)
    for slots in (0, 1):
        other = triton_sample(x, *p, block=block, slots=slots)
        assert other[0].tolist() == base[0].tolist(), f"slots={slots}"
        torch.testing.assert_close(other[1], base[1])
    tokens, x = base[0].cpu(), x.cpu()
    for row in range(x.shape[0]):  # and every token is inside its row's filtered set
        kept = reference_probs(x[row], row_of(p, row)) > 0
        # (tokens tied with the last one the reference keeps stay in the kernel: >=)
        got = x[row, tokens[row]]
        assert got >= x[row][kept].min(), f"row {row}: token {int(tokens[row])} is filtered out"


def logits_read(
    monkeypatch: pytest.MonkeyPatch, x: torch.Tensor, slots: int | None = None, **kw: Any
) -> list[float]:
    """Per row, the logits the kernel loads, in rows' worth (the interpreter's loads,
    counted), one row per program as on a GPU."""
    import numpy as np

    from hotpool.kernels import sampling_candidates, sampling_pivot_search, triton_sampling

    load_tile = sampling_pivot_search.load_tile
    start, row_bytes = x.data_ptr(), x.stride(0) * x.element_size()
    loaded = np.zeros(x.shape[0])

    def counting(base: Any, idx: Any, row_ok: Any, limit: Any, mbase: Any, masked: Any) -> Any:
        row = (int(np.asarray(base.handle.data).ravel()[0]) - start) // row_bytes
        if 0 <= row < x.shape[0]:  # not the candidates' scratch
            loaded[row] += np.count_nonzero((row_ok[:, None] & (idx < limit)).handle.data)
        return load_tile(base, idx, row_ok, limit, mbase, masked)

    for module in (triton_sampling, sampling_candidates, sampling_pivot_search):
        monkeypatch.setattr(module, "load_tile", counting)
    triton_sample(x, *params(x.shape[0], **kw), block=256, slots=slots, rows_per_program=1)
    monkeypatch.undo()
    return (loaded / x.shape[1]).round(2).tolist()


@pytest.mark.skipif(DEVICE.type != "cpu", reason="counts the interpreter's loads")
@pytest.mark.parametrize("kw", [{"top_k": 20}, {"top_p": 0.9}])
def test_top_k_and_top_p_rows_read_the_logits_twice(
    monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any]
) -> None:
    """Their searches read the candidates, not the row: the first pass and the gathering
    read it, the draw one lane; searched over the whole row, every bisection step reads it
    again. Rows shaped like a language model's (a Zipf law, randomly ordered), 32 tiles of
    256 lanes, from flat to peaked: the flattest top_p=0.9 row keeps ~5,000 of 8,192 tokens,
    more than its 4,096 slots, and is searched over the whole row after one pass that finds
    so (two passes more than without slots); the next is gathered again at a higher cut."""
    g = torch.Generator().manual_seed(10)
    ranks = torch.arange(1, 8193, dtype=torch.float32)
    slope = torch.linspace(0.9, 3.0, 8)[:, None]
    x = (-slope * ranks.log() + 0.3 * torch.randn(8, 8192, generator=g))[:, torch.randperm(8192)]
    read = logits_read(monkeypatch, x, **kw)
    whole = logits_read(monkeypatch, x, slots=0, **kw)
    flat = 2 if "top_p" in kw and "top_k" not in kw else 0
    assert max(read[flat:]) < 2.1, f"{kw}: rows read {read}"
    assert read[0] < whole[0] + 2.1 and sum(read) < sum(whole) / 2, f"{read} vs {whole}"
    if flat:
        assert read[1] < 5, f"{kw}: the row gathered again read {read[1]} rows' worth"


def test_a_batch_without_filters_draws_the_same_from_the_kernel_without_them() -> None:
    """``filters=False`` (``sample`` passes it when no row has top_k, top_p or min_p)
    compiles the filters out; greedy and temperature-only rows draw the same tokens."""
    torch.manual_seed(9)
    x = torch.randn(12, 2500) * 3
    p = params(12, temperature=0.8)
    p[0][::3] = 0.0
    p[0][1::3] = 1.7
    full = triton_sample(x.to(DEVICE), *p)
    lean = triton_sample(x.to(DEVICE), *p, filters=False)
    assert lean[0].tolist() == full[0].tolist()
    torch.testing.assert_close(lean[1], full[1])


def row_of(p: tuple[torch.Tensor, ...], row: int) -> SamplingRow:
    return SamplingRow(
        temperature=float(p[0][row]),
        top_k=int(p[1][row]),
        top_p=float(p[2][row]),
        min_p=float(p[3][row]),
    )


@TILING
def test_rows_longer_than_one_block(tiling: int | None) -> None:
    torch.manual_seed(5)
    x = torch.randn(3, 2500)  # three blocks of 1024, the last one short
    x[1, 2400] = 9.0  # the maximum in the short block
    x[2, 100] = x[2, 2000] = 9.0  # a tie across blocks: the first block's wins
    tokens, _ = run(x, *params(3, temperature=0.0), tiling=tiling)
    assert tokens == [int(x[0].argmax()), 2400, 100]
    tokens, logprobs = run(x, *params(3, top_k=5, top_p=0.95), tiling=tiling)
    ids = torch.tensor(tokens)[:, None]
    assert (x.topk(5, dim=1).indices == ids).any(dim=1).all()
    expected = torch.log_softmax(x, dim=1).gather(1, ids).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [1e-30, 1e-38, 1e30])
def test_tiny_and_huge_logits_stay_inside_the_filtered_set(scale: float) -> None:
    torch.manual_seed(6)
    row = torch.randn(77) * 4
    for kw in ({"top_k": 5}, {"top_p": 0.3}, {"min_p": 0.5}, {}):
        tokens = draws(row * scale, 24, temperature=scale, **kw)
        allowed = reference_probs(row, SamplingRow(**kw)) > 0
        assert allowed[tokens].all(), kw


def test_huge_logits_over_a_small_temperature_do_not_overflow() -> None:
    # x / T overflows float32 here; scores relative to the max do not.
    row = torch.tensor([-3e38, -1e38, 2e38, 1e38, 3e38, 0.0])
    tokens = draws(row, 32, temperature=1e-3)
    assert (tokens == 4).all()


def test_tied_logits_at_the_cut_all_stay() -> None:
    """Documented difference from a sort: top_k and top_p cut at a logit, not a rank."""
    tokens = draws(torch.zeros(40), 60, top_k=3, top_p=0.1)
    assert len(set(tokens.tolist())) > 10


def test_bf16_and_fp16_logits_are_accepted() -> None:
    torch.manual_seed(4)
    x = torch.randn(4, 75)
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        tokens, logprobs = run(low, *params(4, temperature=0.0))
        assert tokens == low.float().argmax(dim=1).tolist()
        ids = torch.tensor(tokens)[:, None]
        expected = torch.log_softmax(low.float(), dim=1).gather(1, ids).squeeze(1)
        torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
        tokens, _ = run(low, *params(4, top_k=3))
        top3 = low.float().topk(3, dim=1).indices
        assert (top3 == torch.tensor(tokens)[:, None]).any(dim=1).all()


@TILING
def test_rows_with_nan_or_inf_or_no_finite_logit_get_no_token(tiling: int | None) -> None:
    x = torch.zeros(6, 64)
    x[0, 5] = float("nan")
    x[1] = float("-inf")
    x[2, :63] = float("-inf")  # one finite token: always that one
    x[3, 7] = float("inf")
    x[5, 1:] = float("-inf")  # one finite token, greedy
    p = params(6, top_p=0.5)
    p[0][5] = 0.0
    tokens, logprobs = run(x, *p, tiling=tiling)
    assert tokens == [-1, -1, 63, -1, tokens[4], 0]
    assert 0 <= tokens[4] < 64
    assert logprobs[[0, 1, 3]].isnan().all()
    assert logprobs[2] == 0.0 and logprobs[5] == 0.0


def test_bad_inputs_raise_value_error() -> None:
    x = torch.randn(3, 50, device=DEVICE)
    good = params(3)
    with pytest.raises(ValueError, match="logits must be"):
        triton_sample(x[0], *good)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        triton_sample(x.double(), *good)
    with pytest.raises(ValueError, match="contiguous"):
        triton_sample(torch.randn(50, 3, device=DEVICE).t(), *good)
    with pytest.raises(ValueError, match=r"top_k must be torch.int32"):
        triton_sample(x, good[0], good[1].long(), *good[2:])
    with pytest.raises(ValueError, match=r"temperature must be a \[3\] tensor"):
        triton_sample(x, good[0][:2], *good[1:])
    with pytest.raises(ValueError, match="offsets must be contiguous"):
        triton_sample(x, *good[:5], torch.arange(6, device=DEVICE)[::2])
    with pytest.raises(ValueError, match="power of two"):
        triton_sample(x, *good, rows_per_program=3)


def test_logits_on_the_wrong_device_raise() -> None:
    other = "cuda" if DEVICE.type == "cpu" else "cpu"
    if other == "cuda" and not torch.cuda.is_available():
        x = torch.randn(3, 50, device="meta")
    else:
        x = torch.randn(3, 50, device=other)
    with pytest.raises(ValueError, match="the Triton sampler runs on CUDA"):
        triton_sample(x, *params(3))


# Compiled in a process of its own: here the kernel was decorated for the interpreter.
COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hotpool.kernels.triton_sampling import _GREEDY_BELOW, _sample_kernel
assert isinstance(_sample_kernel, triton.runtime.JITFunction)
ptr = {"logits_ptr": "*fp32", "temperature_ptr": "*fp32", "top_k_ptr": "*i32",
       "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "seed_ptr": "*i64", "offset_ptr": "*i64",
       "token_ptr": "*i64", "logprob_ptr": "*fp32", "cand_ptr": "*fp32", "mask_ptr": "*i32"}
for dtype, block, prefetch, filters, mask in (
    ("fp32", 1024, False, True, False), ("bf16", 64, True, True, False),
    ("fp32", 2048, True, False, False), ("bf16", 2048, True, True, True),
    ("fp32", 2048, True, False, True),
):
    signature = {**ptr, "logits_ptr": "*" + dtype, "stride_row": "i32", "stride_mask": "i32",
                 "B": "i32", "V": "i32", "GREEDY_BELOW": "constexpr", "BLOCK": "constexpr",
                 "ROWS": "constexpr", "SLOTS": "constexpr", "PREFETCH": "constexpr",
                 "CHUNK": "constexpr", "FILTERS": "constexpr", "HAS_MASK": "constexpr"}
    constexprs = {"GREEDY_BELOW": _GREEDY_BELOW, "BLOCK": block, "ROWS": 1, "SLOTS": 16,
                  "PREFETCH": prefetch, "CHUNK": 32, "FILTERS": filters, "HAS_MASK": mask}
    src = ASTSource(fn=_sample_kernel, signature=signature, constexprs=constexprs)
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the other tests compile it on the GPU")
def test_the_kernel_compiles_for_a_hopper_gpu_without_one() -> None:
    """The interpreter runs Python: what only the compiler rejects (a loop-carried value that
    changes type, say) would first show on a GPU. Triton's own ptxas builds sm_90 code here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
