"""Interleaved GGUF blocks (kernels/quant_interleave.py): the same bytes reordered in
groups of 16 output features, what the CPU kernels read on AMX machines. The layout round
trips byte for byte; the kernels on it compute x @ deq(W).T for every row count (the
streaming path up to 4 rows; on AMX, scaled block products up to 96, split weights beyond,
256 rows a call); a NaN or inf row spoils only itself; for_device picks the layout where it
is faster; bad input is a clear ValueError."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from quant_cases import assert_matches_reference, make_weight

from hotpool.kernels import quant_ops
from hotpool.kernels.quant_interleave import deinterleave, interleave
from hotpool.kernels.quant_linear import QuantizedLinear, for_device, quant_linear
from hotpool.kernels.quant_weight import GgufKind, InterleavedWeight

KINDS = ("Q8_0", "Q4_0", "Q4_1")


@pytest.mark.parametrize("fmt", KINDS)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (16, 64), (37, 96), (48, 576)])
def test_the_layout_round_trips_byte_for_byte(fmt: str, n: int, k: int) -> None:
    qw = make_weight(fmt, n, k, torch.Generator().manual_seed(n + k))
    iw = interleave(qw)
    groups = -(-n // 16)
    assert iw.data.shape == (groups, 16 * qw.data.shape[1])  # the same bytes, padded to 16
    assert torch.equal(deinterleave(iw).data, qw.data)


def test_a_group_s_scales_then_its_column_pairs() -> None:
    """Q4_1's first block of group 0: 16 d, 16 m, then pair 0 is column 0 | column 1 << 4."""
    qw = make_weight("Q4_1", 16, 32, torch.Generator().manual_seed(1))
    block = interleave(qw).data[0]
    rows = qw.data.reshape(16, 20)
    assert torch.equal(block[:32].reshape(16, 2), rows[:, 0:2])  # d
    assert torch.equal(block[32:64].reshape(16, 2), rows[:, 2:4])  # m
    col0, col1 = rows[:, 4] & 0xF, rows[:, 5] & 0xF  # columns 0 and 1: bytes 0, 1 low
    assert torch.equal(block[64:80], col0 | (col1 << 4))


@pytest.mark.parametrize("fmt", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_row_count_against_the_reference(fmt: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    n, k = 37, 96  # a last group of 5 features
    qw = make_weight(fmt, n, k, gen)
    iw = interleave(qw)
    xs = torch.randn(300, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    for m in [*range(1, 18), 31, 32, 33, 48, 64, 96, 97, 100, 255, 256, 300]:
        b = bias if m % 2 else None
        assert_matches_reference(quant_linear(xs[:m], iw, b), xs[:m], qw, b)


@pytest.mark.parametrize("fmt", KINDS)
def test_model_sized_layers_and_strided_rows(fmt: str) -> None:
    gen = torch.Generator().manual_seed(3)
    qw = make_weight(fmt, 300, 576, gen)
    iw = interleave(qw)
    wide = torch.randn(120, 700, generator=gen)
    for m in (1, 4, 40, 120):
        x = wide[:m, 50:626]  # rows 700 apart
        assert_matches_reference(quant_linear(x, iw), x, qw)


@pytest.mark.parametrize("fmt", KINDS)
@pytest.mark.parametrize("m", [3, 9, 120])
def test_a_non_finite_activation_spoils_only_its_own_row(fmt: str, m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    qw = make_weight(fmt, 40, 96, gen)
    iw = interleave(qw)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, 96, generator=gen).to(dtype)
            x[m // 2, 50] = bad
            y = quant_linear(x, iw)
            assert not torch.isfinite(y[m // 2]).any()
            rest = [i for i in range(m) if i != m // 2]
            assert_matches_reference(y[rest], x[rest], qw)


def test_for_device_interleaves_where_the_kernels_read_it_faster() -> None:
    ops = quant_ops.load()
    gen = torch.Generator().manual_seed(5)
    qw = make_weight("Q4_1", 40, 64, gen)
    placed = for_device(qw, "cpu")
    assert isinstance(placed, InterleavedWeight) == bool(ops is not None and ops.interleaves(qw))
    layer = QuantizedLinear(placed)
    x = torch.randn(3, 64, generator=gen)
    assert_matches_reference(layer(x), x, qw)
    # .to() keeps the layout; copies and pickles bind a kernel of their own (the bound
    # one holds raw pointers to this layer's tensors)
    assert type(layer.to("cpu").weight) is type(placed)
    twin = copy.deepcopy(layer)
    assert torch.equal(twin(x), layer(x)) and twin._bound is not layer._bound
    assert torch.equal(pickle.loads(pickle.dumps(layer))(x), layer(x))
    if isinstance(placed, InterleavedWeight):
        assert "Q4_1 interleaved" in repr(layer)
    # Q4_K and int8 per feature stay as they are
    q4k = make_weight("Q4_K", 8, 256, gen)
    assert for_device(q4k, "cpu") is not None and not isinstance(
        for_device(q4k, "cpu"), InterleavedWeight
    )


def test_bad_input_is_a_clear_error() -> None:
    gen = torch.Generator().manual_seed(9)
    with pytest.raises(ValueError, match="Q4_K does not interleave"):
        interleave(make_weight("Q4_K", 16, 256, gen))
    with pytest.raises(ValueError, match="data must be"):
        InterleavedWeight(GgufKind.Q4_0, torch.zeros(1, 10, dtype=torch.uint8), (16, 32))
    with pytest.raises(ValueError, match="only"):
        InterleavedWeight(GgufKind.Q4_K, torch.zeros(1, 2304, dtype=torch.uint8), (16, 256))
    iw = interleave(make_weight("Q8_0", 16, 32, gen))
    with pytest.raises(ValueError, match="features"):
        quant_linear(torch.randn(2, 64), iw)
