"""The Triton weight-only linears (kernels/triton_quant_linear.py): int8 with a scale per
output feature or per group (GGUF Q8_0 repacked), int4 groups of 32/64/128, symmetric or
with a minimum (GGUF Q4_0 / Q4_1 / Q4_K repacked), against the float64 product with the
dequantized weights; every row count up to 256; input checks.

Without a GPU the kernels run in Triton's CPU interpreter (``conftest.py`` sets
``TRITON_INTERPRET``), which is slow: shapes stay small. The interpreter truncates float32
to bfloat16 where a GPU rounds to nearest, so bfloat16 outputs get one full step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from quant_cases import assert_matches_reference, make_weight

from hotpool.kernels.quant_torch import repack_for_triton
from hotpool.kernels.quant_weight import Int4Weight, QuantizedWeight, quantize_int4
from hotpool.kernels.triton_quant_linear import kernel_device, triton_quant_linear

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

DEVICE = kernel_device()
STEP = 2**-7  # a bfloat16 output: one step (see above)


def _weight(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    if fmt.startswith("int4"):  # int4-<group>-<sym|asym>
        _, group, kind = fmt.split("-")
        w = torch.randn(n, k, generator=gen)
        return quantize_int4(w, group_size=int(group), symmetric=kind == "sym")
    return repack_for_triton(make_weight(fmt, n, k, gen))


def _check(
    qw: QuantizedWeight,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: tuple[int, int] | None = None,
) -> None:
    b = None if bias is None else bias.to(DEVICE)
    y = triton_quant_linear(x.to(DEVICE), qw.to(DEVICE), b, tiles)
    assert_matches_reference(y.cpu(), x, qw, bias, bf16_step=STEP)


@pytest.mark.parametrize(
    "fmt", ["int8", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "int4-64-sym", "int4-128-asym"]
)
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_format_is_the_float64_product(fmt: str, m: int, dtype: torch.dtype) -> None:
    """Odd feature counts (37, 70) against tiles of 16-128; k of several groups."""
    gen = torch.Generator().manual_seed(m)
    n = 37 if m % 2 else 70
    k = {"int8": 101, "Q4_K": 256, "int4-64-sym": 192, "int4-128-asym": 256}.get(fmt, 96)
    qw = _weight(fmt, n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    _check(qw, x, torch.randn(n, generator=gen) if m != 5 else None)


@pytest.mark.parametrize("fmt", ["int8", "Q8_0", "int4-32-sym", "int4-32-asym"])
@pytest.mark.parametrize("m", [1, 17, 50])
def test_tiles_of_16_cover_several_programs_each_way(fmt: str, m: int) -> None:
    """A GPU's tiling, which the interpreter's wide default tiles never split: programs
    along both m and n, with ragged last tiles."""
    gen = torch.Generator().manual_seed(m)
    qw = _weight(fmt, 45, 64, gen)
    x = torch.randn(m, 64, generator=gen)
    _check(qw, x, torch.randn(45, generator=gen), tiles=(16, 16))


@pytest.mark.parametrize("fmt", ["int8", "int4-32-asym"])
def test_every_row_count_up_to_256(fmt: str) -> None:
    gen = torch.Generator().manual_seed(7)
    qw = _weight(fmt, 19, 32, gen)
    xs = torch.randn(256, 32, generator=gen)
    bias = torch.randn(19, generator=gen)
    for m in range(1, 257):
        _check(qw, xs[:m], bias if m % 2 else None)


def test_gguf_blocks_must_be_repacked_first() -> None:
    gguf = make_weight("Q4_0", 8, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="repack_for_triton"):
        triton_quant_linear(torch.randn(1, 32, device=DEVICE), gguf.to(DEVICE))
    assert isinstance(repack_for_triton(gguf), Int4Weight)


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (torch.randn(2, 3, 64), "2-D"),
        (torch.randn(2, 64).half(), "float32 or bfloat16"),
        (torch.randn(2, 32), "k = 64"),
        (torch.randn(64, 2).T, "rows must be contiguous"),
    ],
)
def test_bad_inputs_are_refused(x: torch.Tensor, message: str) -> None:
    qw = _weight("int4-32-sym", 8, 64, torch.Generator().manual_seed(0)).to(DEVICE)
    with pytest.raises(ValueError, match=message):
        triton_quant_linear(x.to(DEVICE), qw)


def test_bad_tiles_are_refused() -> None:
    qw = _weight("int8", 8, 64, torch.Generator().manual_seed(0)).to(DEVICE)
    with pytest.raises(ValueError, match="powers of two"):
        triton_quant_linear(torch.randn(1, 64, device=DEVICE), qw, tiles=(8, 16))
