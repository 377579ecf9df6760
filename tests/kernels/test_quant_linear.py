"""Weight-only quantized linears on the CPU (kernels/quant_ops.c through quant_linear):
every format against the float64 product with its dequantized weights, for every row
count up to 256, odd shapes, float32 and bfloat16 activations, with and without a bias;
the portable C build against the AVX2 one; the torch fallback; the module; bad input."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from cpu_flags import target_flags
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from quant_cases import CPU_FORMATS, assert_matches_reference, block_k, make_weight

from hotpool.kernels import quant_ops
from hotpool.kernels.quant_interleave import interleave
from hotpool.kernels.quant_linear import QuantizedLinear, for_device, quant_linear
from hotpool.kernels.quant_reference import dequantize_reference
from hotpool.kernels.quant_torch import repack_for_triton, torch_quant_linear
from hotpool.kernels.quant_weight import (
    GgufKind,
    GgufWeight,
    Int8Weight,
    from_gguf_bytes,
    quantize_int4,
    quantize_int8,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture(scope="module")
def ops() -> quant_ops.QuantOps:
    kernels = quant_ops.load()
    if kernels is None:  # the suite runs where a C compiler exists (CI does)
        pytest.fail("the quantized C kernels did not build; see quant_ops.load's warning")
    return kernels


def test_the_build_follows_its_target_cpu(ops: quant_ops.QuantOps) -> None:
    flags = target_flags()
    avx2 = all(f" {f}" in flags for f in ("avx2", "fma", "f16c"))
    avx512 = avx2 and all(
        f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
    )
    bf16 = avx512 and " avx512_bf16" in flags
    expected = "avx512_bf16" if bf16 else "avx512" if avx512 else "avx2" if avx2 else "portable"
    assert ops.simd == expected


@pytest.mark.parametrize("fmt", CPU_FORMATS)
@DTYPES
def test_every_row_count_up_to_256(ops: quant_ops.QuantOps, fmt: str, dtype: torch.dtype) -> None:
    """Streaming (1-2 rows), register tiles of 3 rows with 1- and 2-row tails, a panel
    of 16 features cut to 19: each m from 1 to 256, a bias on odd m."""
    gen = torch.Generator().manual_seed(len(fmt))
    n, k = 19, 2 * block_k(fmt)
    qw = make_weight(fmt, n, k, gen)
    xs = torch.randn(256, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    for m in range(1, 257):
        b = bias if m % 2 else None
        assert_matches_reference(quant_linear(xs[:m], qw, b), xs[:m], qw, b)


@pytest.mark.parametrize("fmt", CPU_FORMATS)
@pytest.mark.parametrize(("n", "blocks"), [(37, 3), (70, 2), (1, 1)])
@pytest.mark.parametrize("m", [1, 2, 5, 64])
@DTYPES
def test_odd_shapes(
    ops: quant_ops.QuantOps, fmt: str, n: int, blocks: int, m: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(n * m + blocks)
    k = blocks * block_k(fmt)
    qw = make_weight(fmt, n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    assert_matches_reference(ops.linear(x, qw, None), x, qw)
    assert_matches_reference(ops.linear(x, qw, bias), x, qw, bias)


@pytest.mark.parametrize("fmt", CPU_FORMATS)
@pytest.mark.parametrize("m", [1, 2, 33, 256])
def test_model_sized_layers(ops: quant_ops.QuantOps, fmt: str, m: int) -> None:
    """SmolLM2's k = 576 (Q4_K: 768, its super-blocks need 256s), parallel over threads."""
    gen = torch.Generator().manual_seed(m)
    n, k = (300, 768) if fmt == "Q4_K" else (200, 576)
    qw = make_weight(fmt, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    assert_matches_reference(quant_linear(x, qw, bias), x, qw, bias)


@pytest.mark.parametrize("k", [1, 7, 45, 100])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_int8_takes_any_width(ops: quant_ops.QuantOps, k: int, m: int) -> None:
    gen = torch.Generator().manual_seed(k * m)
    qw = make_weight("int8", 21, k, gen)
    x = torch.randn(m, k, generator=gen)
    assert_matches_reference(quant_linear(x, qw), x, qw)


@pytest.mark.parametrize("m", [1, 2, 9])
def test_rows_may_be_strided(ops: quant_ops.QuantOps, m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    qw = make_weight("Q4_0", 24, 64, gen)
    wide = torch.randn(m, 100, generator=gen)
    for x in (wide[:, 10:74], wide.bfloat16()[:, :64]):
        assert x.stride(0) == 100
        assert_matches_reference(quant_linear(x, qw), x, qw)


@pytest.mark.parametrize("fmt", CPU_FORMATS)
@pytest.mark.parametrize("m", [1, 3, 9])
def test_a_non_finite_activation_spoils_only_its_own_row(
    ops: quant_ops.QuantOps, fmt: str, m: int
) -> None:
    """NaN or inf in a row (a diverged model) gives that row no finite output, never a
    made-up number; the other rows are unaffected."""
    gen = torch.Generator().manual_seed(m)
    k = 2 * block_k(fmt)
    qw = make_weight(fmt, 7, k, gen)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(m, k, generator=gen)
        x[m // 2, k // 3] = bad
        y = ops.linear(x, qw, None)
        assert not torch.isfinite(y[m // 2]).any()
        rest = [i for i in range(m) if i != m // 2]
        if rest:
            assert_matches_reference(y[rest], x[rest], qw)


def test_the_identity_reads_back_gguf_s_dequantized_weights(ops: quant_ops.QuantOps) -> None:
    """x = I makes y = deq(W).T: the kernel's dequantization of each format against gguf's,
    to float32 rounding (one fused multiply-add where gguf rounds twice)."""
    gen = torch.Generator().manual_seed(3)
    for fmt in CPU_FORMATS:
        k = block_k(fmt)
        qw = make_weight(fmt, 40, k, gen)
        for m in (1, 2, k):  # both paths: rows one by one, and a tiled identity
            eye = torch.eye(k)[:m]
            y = ops.linear(eye, qw, None).double()
            # AMX tiles read each weight as two bfloat16 (hi + lo): 16 bits of it
            rtol = 2**-15 if ops.amx and m > 4 else 1e-6
            torch.testing.assert_close(y, dequantize_reference(qw)[:, :m].T, rtol=rtol, atol=0)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets")
@pytest.mark.parametrize(
    ("march", "extra", "simd"),
    [
        ("x86-64", (), "portable"),
        ("haswell", (), "avx2"),
        ("native", ("-mno-amx-tile",), "avx512_bf16"),  # its vdpbf16ps panels (Zen 4's)
        # Cascade Lake's and Ice Lake's: VNNI streaming, the tiled path past it
        ("native", ("-mno-amx-tile", "-mno-avx512bf16"), "avx512"),
    ],
)
def test_every_build_computes_the_same_function(
    ops: quant_ops.QuantOps, tmp_path: Path, march: str, extra: tuple[str, ...], simd: str
) -> None:
    """The host's build (AVX-512 with AMX tiles where the CPU has them) against the
    portable C, the AVX2, the AVX-512-without-AMX and the AVX-512-without-BF16 builds: each
    path is checked on any x86-64 host that can run it."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if simd == "avx2" and not all(f" {f}" in flags for f in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU cannot run the AVX2 build")
    if simd == "avx512_bf16" and ops.simd != simd:
        pytest.skip("this CPU has no AVX-512 BF16")
    if simd == "avx512" and ops.simd not in ("avx512", "avx512_bf16"):
        pytest.skip("this CPU has no AVX-512 VNNI")
    portable = quant_ops.QuantOps(quant_ops.build(tmp_path, march=march, extra=extra))
    assert portable.simd == simd and not (extra and portable.amx)
    gen = torch.Generator().manual_seed(5)
    for fmt in CPU_FORMATS:
        qw = make_weight(fmt, 37, 2 * block_k(fmt), gen)
        bias = torch.randn(37, generator=gen)
        # the layouts this build reads: interleaved blocks where it serves them so
        layouts = [qw, *([interleave(qw)] if portable.interleaves(qw) else [])]
        for m in (1, 2, 3, 4, 5, 20, 64):
            x32 = torch.randn(m, qw.shape[1], generator=gen)
            for x in (x32, x32.bfloat16()):
                for w in layouts:
                    y = portable.linear(x, w, bias)
                    assert_matches_reference(y, x, qw, bias)
                    if simd == "avx512" and m <= 4:  # the streaming path, as the host's
                        assert torch.equal(y, ops.linear(x, w, bias))
                assert_matches_reference(ops.linear(x, qw, bias), x, qw, bias)
    # fp16 scales below 2**-14 are subnormal: the portable converter must widen them exactly
    d = torch.tensor([2**-20, -(2**-15), 6e-8], dtype=torch.float16).view(torch.uint8)
    raw = torch.zeros(3, 18, dtype=torch.uint8)
    raw[:, :2], raw[:, 2:] = d.reshape(3, 2), 0x9F
    qw = GgufWeight(GgufKind.Q4_0, raw, (3, 32))
    x = torch.ones(1, 32)
    assert torch.equal(portable.linear(x, qw, None), ops.linear(x, qw, None))
    assert_matches_reference(portable.linear(x, qw, None), x, qw, rtol=1e-6)


@pytest.mark.parametrize("fmt", [*CPU_FORMATS, "int4", "int4-asym", "int8-groups"])
@pytest.mark.parametrize("m", [1, 6])
def test_the_torch_fallback_is_the_same_function(fmt: str, m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    if fmt.startswith("int4"):
        w = torch.randn(24, 128, generator=gen)
        qw = quantize_int4(w, group_size=64, symmetric=fmt == "int4")
    elif fmt == "int8-groups":
        qw = repack_for_triton(make_weight("Q8_0", 24, 128, gen))
    else:
        qw = make_weight(fmt, 24, 2 * block_k(fmt), gen)
    x = torch.randn(m, qw.shape[1], generator=gen)
    bias = torch.randn(24, generator=gen)
    assert_matches_reference(torch_quant_linear(x, qw, bias), x, qw, bias)
    assert_matches_reference(quant_linear(x.bfloat16(), qw, bias), x.bfloat16(), qw, bias)


@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_repacking_for_the_gpu_keeps_the_weights(fmt: str) -> None:
    gen = torch.Generator().manual_seed(1)
    qw = make_weight(fmt, 9, 2 * block_k(fmt), gen)
    repacked = repack_for_triton(qw)
    assert repacked.nbytes <= 2 * qw.nbytes + 8 * 9 * 2 * block_k(fmt) // 32  # no float copy
    torch.testing.assert_close(
        dequantize_reference(repacked), dequantize_reference(qw), rtol=1e-6, atol=1e-9
    )
    assert for_device(qw, "cpu") is not None and for_device(qw, "cpu").shape == qw.shape


def test_quantize_int8_rounds_to_nearest_per_output_feature() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 40, generator=gen)
    w[2] = 0.0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5,)
    assert torch.equal(q[2], torch.zeros(40, dtype=torch.int8)) and scale[2] > 0
    torch.testing.assert_close(scale[[0, 1, 3, 4]], w.abs().amax(1)[[0, 1, 3, 4]] / 127)
    assert (w - q.float() * scale[:, None]).abs().le(scale[:, None] / 2 + 1e-7).all()
    assert q.abs().amax(1)[[0, 1, 3, 4]].eq(127).all()


def test_quantize_int4_rounds_each_group() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 128, generator=gen)
    w[1, :32] = 0.5  # a constant group
    for symmetric in (True, False):
        qw = quantize_int4(w, group_size=32, symmetric=symmetric)
        step = qw.scale.repeat_interleave(32, dim=1).double()
        assert (dequantize_reference(qw) - w.double()).abs().le(step / 2 + 1e-6).all()


def test_from_gguf_bytes_keeps_the_file_s_blocks() -> None:
    w = np.random.default_rng(0).standard_normal((6, 64), dtype=np.float32)
    raw = quantize(w, GGMLQuantizationType.Q4_1)
    for source in (raw, raw.tobytes(), torch.from_numpy(raw.copy())):
        qw = from_gguf_bytes("q4_1", source, (6, 64))
        assert qw.kind is GgufKind.Q4_1 and qw.data.shape == (6, 40)
        assert np.array_equal(qw.data.numpy(), raw)
    expected = dequantize(raw, GGMLQuantizationType.Q4_1)
    assert np.array_equal(dequantize_reference(from_gguf_bytes(3, raw, (6, 64))).numpy(), expected)


def test_the_c_code_sizes_blocks_as_gguf_does(ops: quant_ops.QuantOps) -> None:
    for kind in GgufKind:
        one = torch.zeros(1, kind.block_bytes, dtype=torch.uint8)
        assert ops.row_bytes(GgufWeight(kind, one, (1, kind.block_size))) == kind.block_bytes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("q4_0", bytes(18 * 2), (2, 48)), "multiple of Q4_0's block of 32"),
        (("q4_k", bytes(144), (1, 128)), "multiple of Q4_K's block of 256"),
        (("q4_0", bytes(17), (1, 32)), "has 18 bytes, got 17"),
        (("q5_0", bytes(22), (1, 32)), "unsupported GGUF type"),
        ((6, bytes(22), (1, 32)), "unsupported GGUF type"),
        (("q8_0", bytes(34), (34,)), "shape must be"),
    ],
)
def test_bad_gguf_tensors_are_refused(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_gguf_bytes(*args)


def test_bad_weights_are_refused() -> None:
    q = torch.zeros(4, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"q must be torch\.int8"):
        Int8Weight(q.float(), torch.ones(4))
    with pytest.raises(ValueError, match="scale must be float32"):
        Int8Weight(q, torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale must be"):
        Int8Weight(q, torch.ones(5))
    with pytest.raises(ValueError, match="data must be"):
        GgufWeight(GgufKind.Q8_0, torch.zeros(4, 33, dtype=torch.uint8), (4, 32))
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.randn(2, 96), group_size=48)
    with pytest.raises(ValueError, match="multiple of int4"):
        quantize_int4(torch.randn(2, 96), group_size=64)


@pytest.mark.parametrize(
    ("x", "bias", "message"),
    [
        (torch.randn(64), None, "2-D"),
        (torch.randn(2, 3, 64), None, "2-D"),
        (torch.randn(2, 64).half(), None, "float32 or bfloat16"),
        (torch.ones(2, 64, dtype=torch.int32), None, "float32 or bfloat16"),
        (torch.randn(2, 63), None, "k = 64"),
        (torch.randn(64, 2).T, None, "rows must be contiguous"),
        (torch.randn(2, 64), torch.randn(7), r"bias must be a floating-point \[8\]"),
        (torch.randn(2, 64), torch.ones(8, dtype=torch.int64), "bias must be"),
    ],
)
def test_bad_inputs_are_refused(x: torch.Tensor, bias: torch.Tensor | None, message: str) -> None:
    qw = make_weight("Q8_0", 8, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=message):
        quant_linear(x, qw, bias)


@DTYPES
def test_quantized_linear_stands_in_for_nn_linear(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    for fmt in CPU_FORMATS:
        qw = make_weight(fmt, 33, block_k(fmt), gen)
        bias = torch.randn(33, generator=gen)
        layer = QuantizedLinear(qw, bias)
        x = torch.randn(2, 3, qw.shape[1], generator=gen).to(dtype)
        y = layer(x)
        assert y.shape == (2, 3, 33) and y.dtype == dtype
        assert_matches_reference(y.reshape(6, 33), x.reshape(6, -1), qw, bias)
        assert "qweight" in layer.state_dict() and layer.to("cpu").weight.shape == qw.shape
    plain = QuantizedLinear(quantize_int4(torch.randn(4, 64), 32))
    assert plain(torch.randn(1, 64)).shape == (1, 4)


def test_casting_the_module_keeps_its_scales_in_float32() -> None:
    """``model.to(torch.bfloat16)`` casts floating buffers: the layer keeps its own."""
    gen = torch.Generator().manual_seed(4)
    qw = make_weight("int8", 16, 64, gen)
    bias = torch.randn(16, generator=gen)
    layer = QuantizedLinear(qw, bias).to(torch.bfloat16)
    assert layer.qscale.dtype == torch.float32 and layer.bias.dtype == torch.float32
    x = torch.randn(3, 64, generator=gen).bfloat16()
    assert_matches_reference(layer(x), x, qw, bias)
