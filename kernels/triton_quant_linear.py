"""Weight-only quantized linear layers in Triton (the CUDA path): ``y = x @ W.T (+ bias)``
for :class:`Int8Weight` (a scale per output feature, or per group of columns: GGUF Q8_0
repacked) and :class:`Int4Weight` (groups of 32, 64 or 128, symmetric or with a minimum:
GGUF Q4_0 / Q4_1 / Q4_K repacked by :func:`hotpool.kernels.quant_torch.repack_for_triton`).

Each program owns a ``[BLOCK_M, BLOCK_N]`` tile of ``y`` and walks k one group at a time:
it loads the quantized tile, turns it into the integers it stands for (int8, or nibbles,
``- 8`` where symmetric), multiplies them with ``x`` through ``tl.dot`` and only then applies
the group's float32 scale (and ``minimum * sum(x)`` of the group): the integers are exact
in bfloat16, so bfloat16 activations use tensor cores with exact products, and float32
ones stay float32 (``input_precision="ieee"``, no TF32). The float32 accumulator is
rounded to ``x``'s dtype once, at the store.

``UPCAST`` (CPU tensors: Triton's interpreter) multiplies in float32 instead: the
interpreter's ``tl.dot`` takes bf16 bit patterns for integers, and it mis-converts integers
to bf16; every operand is an exact bf16 value, so the products are the same. (The branch
is inline: a nested jit function costs the interpreter milliseconds a call.)

The torch reference is :func:`hotpool.kernels.quant_torch.torch_quant_linear` (and the
float64 one, :mod:`hotpool.kernels.quant_reference`); tests run these kernels in Triton's
CPU interpreter. Not yet timed on a GPU: one program per tile of output features leaves
SMs idle for a single decode row of a narrow layer (no split over k yet).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hotpool.kernels.quant_inputs import check_linear_inputs
from hotpool.kernels.quant_weight import GgufWeight, Int4Weight, Int8Weight, QuantizedWeight


@triton.jit
def _int8_kernel(
    x_ptr, q_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # GROUP 0: one scale per output feature, applied at the end; else BLOCK_K == GROUP and
    # each step's partial product takes its group's scale.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    q_rows = q_ptr + rn[None, :].to(tl.int64) * stride_qn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(q_rows + (k0 + rk)[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)
        if UPCAST:  # see the module's docstring
            part = tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, q.to(x.dtype), input_precision="ieee")
        if GROUP == 0:
            acc += part
        else:
            s = tl.load(s_ptr + rn.to(tl.int64) * stride_sn + k0 // GROUP, mask=n_ok, other=0.0)
            acc += part * s[None, :]
    if GROUP == 0:
        acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0)[None, :]
    y = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_kernel(
    x_ptr, p_ptr, s_ptr, mn_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_pn, stride_sn, stride_ym,
    GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Byte i of a row holds columns 2 i (low nibble) and 2 i + 1 (high): a group is GROUP / 2
    # bytes, dotted with x's even and odd columns of the group.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, GROUP // 2)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    p_rows = p_ptr + rn[None, :].to(tl.int64) * stride_pn
    s_rows = rn.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, GROUP):
        p = tl.load(p_rows + (k0 // 2 + rb)[:, None], mask=n_ok[None, :], other=0)
        lo = (p & 0xF).to(tl.int32)
        hi = (p >> 4).to(tl.int32)
        if SYMMETRIC:
            lo -= 8
            hi -= 8
        xe = tl.load(x_rows + (k0 + 2 * rb)[None, :], mask=m_ok[:, None], other=0.0)
        xo = tl.load(x_rows + (k0 + 2 * rb + 1)[None, :], mask=m_ok[:, None], other=0.0)
        if UPCAST:  # see the module's docstring
            xe32, xo32 = xe.to(tl.float32), xo.to(tl.float32)
            part = tl.dot(xe32, lo.to(tl.float32), input_precision="ieee")
            part += tl.dot(xo32, hi.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(xe, lo.to(xe.dtype), input_precision="ieee")
            part += tl.dot(xo, hi.to(xo.dtype), input_precision="ieee")
        g = k0 // GROUP
        acc += part * tl.load(s_ptr + s_rows + g, mask=n_ok, other=0.0)[None, :]
        if not SYMMETRIC:
            xsum = tl.sum(xe.to(tl.float32) + xo.to(tl.float32), axis=1)
            acc += xsum[:, None] * tl.load(mn_ptr + s_rows + g, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0)[None, :]
    y = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` when
    this module was imported): then they take CPU tensors."""
    return not isinstance(_int8_kernel, triton.runtime.JITFunction)


def kernel_device() -> torch.device:
    return torch.device("cpu" if interpreted() else "cuda")


def _tiles(m: int, n: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: tl.dot takes 16 and up; the interpreter prefers few, wide
    programs (its tile ops are numpy calls)."""
    if interpreted():
        return max(triton.next_power_of_2(m), 16), min(max(triton.next_power_of_2(n), 16), 128)
    return min(max(triton.next_power_of_2(m), 16), 64), 64


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != kernel_device().type:
        raise ValueError(f"the Triton kernels take {kernel_device().type} tensors, got {x.device}")


def triton_int8_linear(
    x: torch.Tensor,
    qw: Int8Weight,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``x @ (q * scale).T (+ bias)`` in ``x``'s dtype, with a float32 accumulator."""
    b = check_linear_inputs(x, qw, bias)
    _check_device(x)
    n, k = qw.shape
    group = 0 if qw.scale.dim() == 1 else qw.group_size
    if group and (group < 16 or group & (group - 1)):
        raise ValueError(f"int8 groups must be a power of two >= 16 columns, got {group}")
    m = x.shape[0]
    y = x.new_empty(m, n)
    block_m, block_n = tiles or _tiles(m, n)
    block_k = group or min(triton.next_power_of_2(k), 512 if interpreted() else 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_kernel[grid](
        x, qw.q, qw.scale, b if b is not None else qw.scale, y,
        m, n, k, x.stride(0), qw.q.stride(0), qw.scale.stride(0), y.stride(0),
        GROUP=group, HAS_BIAS=b is not None, UPCAST=x.device.type == "cpu",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=max(block_k, 16),
    )  # fmt: skip
    return y


def triton_int4_linear(
    x: torch.Tensor,
    qw: Int4Weight,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``x @ deq(W).T (+ bias)`` for a group-wise int4 weight, in ``x``'s dtype."""
    b = check_linear_inputs(x, qw, bias)
    _check_device(x)
    n, k = qw.shape
    m = x.shape[0]
    y = x.new_empty(m, n)
    block_m, block_n = tiles or _tiles(m, n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    minimum = qw.minimum if qw.minimum is not None else qw.scale
    _int4_kernel[grid](
        x, qw.packed, qw.scale, minimum, b if b is not None else qw.scale, y,
        m, n, k, x.stride(0), qw.packed.stride(0), qw.scale.stride(0), y.stride(0),
        GROUP=qw.group_size, SYMMETRIC=qw.minimum is None, HAS_BIAS=b is not None,
        UPCAST=x.device.type == "cpu", BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return y


def triton_quant_linear(
    x: torch.Tensor,
    qw: QuantizedWeight,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The kernel for the weight's type; GGUF blocks must be repacked first
    (:func:`hotpool.kernels.quant_torch.repack_for_triton`, once, at load). ``tiles``:
    ``(BLOCK_M, BLOCK_N)``, powers of two from 16, instead of the wrapper's choice."""
    if tiles is not None and any(t < 16 or t & (t - 1) for t in tiles):
        raise ValueError(f"tiles must be powers of two >= 16, got {tiles}")
    if isinstance(qw, Int8Weight):
        return triton_int8_linear(x, qw, bias, tiles)
    if isinstance(qw, Int4Weight):
        return triton_int4_linear(x, qw, bias, tiles)
    if isinstance(qw, GgufWeight):
        raise ValueError("GGUF blocks are not a Triton layout: repack_for_triton(qw) first")
    raise ValueError(f"qw must be a quantized weight, got {type(qw).__name__}")
