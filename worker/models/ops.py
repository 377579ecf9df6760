"""The element-wise steps of a decoder layer, behind one interface with two implementations.

:class:`TorchOps` composes torch ops and runs on any device and dtype (the reference).
:class:`NativeOps` calls the fused C kernels of ``hotpool.kernels.cpu_ops``: one pass per
step where torch needs several (RMSNorm alone is eight aten ops on bfloat16), which is most
of a small model's decode time on the CPU. :func:`ops_for` picks NativeOps for bfloat16 on
the CPU when the kernels build, TorchOps otherwise. Both compute HF transformers' functions;
NativeOps rounds to bfloat16 wherever HF's bfloat16 modules do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hotpool.kernels import cpu_ops
from hotpool.worker.models.rope import RotaryEmbedding, apply_rope

# What a step's RoPE needs, prepared once per forward pass and shared by every layer.
RopeInputs = tuple[Any, ...]


class TorchOps:
    name = "torch"

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``table`` for ``ids``: a fresh tensor (the residual stream)."""
        return F.embedding(ids, table)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``x += y`` in place."""
        x.add_(y)

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in float32 (the logits' dtype)."""
        return x.float()

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += x`` in place (unless x is None); returns RMSNorm(residual) * weight."""
        if x is not None:
            residual.add_(x)
        # One fused op (it accumulates in fp32 for bf16/fp16 inputs) instead of six.
        return F.rms_norm(residual, weight.shape, weight, eps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm(x) * weight over the last dimension (QK-norm's heads, Gemma's outputs)."""
        return F.rms_norm(x, weight.shape, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): ``gelu_tanh(gate) * up`` for ``[gate | up]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rope_inputs(
        self, rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeInputs:
        return rope(positions, dtype)

    def rope_(self, x: torch.Tensor, heads: int, inputs: RopeInputs) -> None:
        """RoPE in place on heads ``[0, heads)`` of ``x`` ``[T, H, D]``."""
        cos, sin = inputs
        x[:, :heads] = apply_rope(x[:, :heads], cos, sin)


class NativeOps(TorchOps):
    name = "native"

    def __init__(self, kernels: cpu_ops.CpuOps) -> None:
        self.kernels = kernels

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.kernels.add_rms_norm(x, residual, weight, eps)

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if table.is_contiguous() and ids.dim() == 1 and ids.dtype == torch.int64:
            return self.kernels.embed(table, ids)
        return super().embed(table, ids)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.is_contiguous() and y.is_contiguous() and x.shape == y.shape:
            self.kernels.add_(x, y)
        else:
            super().add_(x, y)

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.widen(x) if x.is_contiguous() else super().widen(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous():  # the fused kernel's rows (sublayer outputs)
            return self.kernels.add_rms_norm(None, x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)

    def rope_inputs(
        self, rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeInputs:
        cos, sin = rope.tables(dtype)
        return positions, cos, sin

    def rope_(self, x: torch.Tensor, heads: int, inputs: RopeInputs) -> None:
        positions, cos, sin = inputs
        self.kernels.rope_(x, heads, positions, cos, sin)


def ops_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> TorchOps:
    """The fastest implementation that runs ``dtype`` on ``device``."""
    if device.type == "cpu" and dtype == torch.bfloat16 and head_dim <= cpu_ops.MAX_HEAD_DIM:
        kernels = cpu_ops.load()
        if kernels is not None:
            return NativeOps(kernels)
    return TorchOps()
