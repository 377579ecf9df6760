"""Weight-only quantized linear layers: ``quant_linear(x, qw, bias)`` and the
:class:`QuantizedLinear` module that stands in for ``nn.Linear``.

Dispatch, by where the weight lives and what it is:

- CPU: the C kernels (:mod:`hotpool.kernels.quant_ops`) for GGUF blocks (Q8_0, Q4_0, Q4_1,
  Q4_K, read as the file stores them) and int8 with a scale per output feature;
- CUDA: the Triton kernels (:mod:`hotpool.kernels.triton_quant_linear`) for int8 and int4,
  the layouts :func:`for_device` repacks GGUF blocks into;
- anything else (no C compiler, no Triton, group-wise int8 or int4 on a CPU, GGUF blocks on
  a GPU that were not repacked): :func:`hotpool.kernels.quant_torch.torch_quant_linear`,
  the same function, a chunk of rows at a time.

All paths compute ``x @ deq(W).T (+ bias)`` with float32 accumulation and return ``x``'s
dtype (float32 or bfloat16).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from hotpool.kernels import quant_ops
from hotpool.kernels.quant_inputs import check_linear_inputs
from hotpool.kernels.quant_interleave import deinterleave, interleave
from hotpool.kernels.quant_torch import repack_for_triton, torch_quant_linear
from hotpool.kernels.quant_weight import (
    GgufKind,
    GgufWeight,
    Int4Weight,
    Int8Weight,
    InterleavedWeight,
    QuantizedWeight,
)

log = logging.getLogger(__name__)


def quant_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [m, k] @ deq(W).T (+ bias [n])`` -> ``[m, n]`` in ``x``'s dtype. ``x`` is float32
    or bfloat16 on the weight's device with contiguous rows; ValueError otherwise."""
    b = check_linear_inputs(x, qw, bias)
    if x.device.type == "cpu":
        ops = quant_ops.load()
        if ops is not None and ops.supports(qw):
            return ops.linear(x, qw, b)
    elif x.device.type == "cuda":
        kernels = _triton()
        if isinstance(qw, GgufWeight | InterleavedWeight):
            _warn_once("GGUF blocks on a GPU run in torch: repack them once with for_device()")
        elif kernels is not None:
            return kernels.triton_quant_linear(x, qw, b)
    return torch_quant_linear(x, qw, b)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


def for_device(qw: QuantizedWeight, device: torch.device | str) -> QuantizedWeight:
    """The weight on ``device`` in the layout its kernels read there: GGUF blocks stay as
    they are on a CPU (interleaved where its kernels read them faster so,
    :meth:`~hotpool.kernels.quant_ops.QuantOps.interleaves`) and are repacked (once, not
    dequantized) for a GPU."""
    device = torch.device(device)
    if isinstance(qw, InterleavedWeight) and device.type != "cpu":
        qw = deinterleave(qw)
    moved = qw.to(device)
    if device.type == "cuda":
        return repack_for_triton(moved)
    ops = quant_ops.load()
    if ops is not None and ops.interleaves(moved):
        return interleave(moved)  # type: ignore[arg-type]
    return moved


_TRITON: list[object] = []


def _triton():  # the module, or None without Triton
    if not _TRITON:
        try:
            from hotpool.kernels import triton_quant_linear
        except ImportError as exc:
            log.warning("Triton unavailable, quantized linears use torch: %s", exc)
            _TRITON.append(None)
        else:
            _TRITON.append(triton_quant_linear)
    return _TRITON[0]


class QuantizedLinear(nn.Module):
    """``nn.Linear``'s forward over a quantized weight: inputs ``[..., in_features]`` in
    float32 or bfloat16, outputs in the same dtype. The weight's tensors are buffers, so
    ``.to()`` and ``state_dict()`` carry them; build it with the weight already in the
    layout of its device (:func:`for_device`)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._kind = type(weight)
        self._gguf_kind = GgufKind.Q8_0  # read for GGUF weights only
        self._group_size = 0  # read for int4 weights only
        if isinstance(weight, Int8Weight):
            self.register_buffer("qweight", weight.q)
            self.register_buffer("qscale", weight.scale)
        elif isinstance(weight, GgufWeight | InterleavedWeight):
            self.register_buffer("qweight", weight.data)
            self._gguf_kind = weight.kind
        elif isinstance(weight, Int4Weight):
            self.register_buffer("qweight", weight.packed)
            self.register_buffer("qscale", weight.scale)
            self.register_buffer("qmin", weight.minimum)
            self._group_size = weight.group_size
        else:
            raise ValueError(f"weight must be a quantized weight, got {type(weight).__name__}")
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], got {list(bias.shape)}")
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.weight = weight
        self._bound: (
            tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor] | None] | None
        ) = None

    def _apply(self, fn, recurse=True):  # nn.Module's (untyped) signature
        # .to(dtype) would cast floating buffers too (and round the scales): they only move.
        names = [name for name in ("qscale", "qmin", "bias") if name in self._buffers]
        kept = {name: self._buffers.pop(name) for name in names}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, t in kept.items():
                if t is not None:
                    moved = fn(t)
                    t = moved if moved.dtype == t.dtype else t.to(moved.device)
                self._buffers[name] = t
        self.weight = self._rebuild()  # .to() / .cuda() replaced the buffers
        return self

    def _rebuild(self) -> QuantizedWeight:
        if self._kind is Int8Weight:
            return Int8Weight(self.qweight, self.qscale)
        if self._kind is GgufWeight or self._kind is InterleavedWeight:
            shape = (self.out_features, self.in_features)
            return self._kind(self._gguf_kind, self.qweight, shape)
        return Int4Weight(self.qweight, self.qscale, self.qmin, self._group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The engine's case, checked in a few cheap tests: 2-D CPU rows of the activation
        # dtypes go straight to the bound C kernel (quant_linear's checks cost more than a
        # small layer's work at decode).
        if (
            x.dim() == 2
            and x.device.type == "cpu"
            and (x.dtype is torch.bfloat16 or x.dtype is torch.float32)
            and x.shape[1] == self.in_features
            and x.stride(1) == 1
            and (x.shape[0] == 1 or x.stride(0) >= self.in_features)
        ):
            call = self._bound_kernel()
            if call is not None:
                return call(x)
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return quant_linear(rows, self.weight, self.bias).reshape(*lead, self.out_features)

    def _bound_kernel(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The C kernel bound to this layer's weight, rebound when its tensors moved."""
        bias, scale = self._buffers.get("bias"), self._buffers.get("qscale")
        key = tuple(0 if t is None else t.data_ptr() for t in (self.qweight, scale, bias))
        if self._bound is None or self._bound[0] != key:
            ops = quant_ops.load()
            usable = ops is not None and ops.supports(self.weight)
            self._bound = (key, ops.bind(self.weight, bias) if usable else None)  # type: ignore[union-attr]
        return self._bound[1]

    def __getstate__(self) -> dict[str, object]:
        # the bound closure holds raw pointers: copies and pickles bind their own
        state = self.__dict__.copy()
        state["_bound"] = None
        return state

    def extra_repr(self) -> str:
        fmt = self._kind.__name__
        if isinstance(self.weight, GgufWeight | InterleavedWeight):
            interleaved = self._kind is InterleavedWeight
            fmt = self.weight.kind.name + (" interleaved" if interleaved else "")
        return f"in_features={self.in_features}, out_features={self.out_features}, {fmt}"
