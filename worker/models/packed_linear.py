"""Linear layers with weights prepacked once at load, for bf16 on CPU.

``F.linear`` on bf16 CPU tensors lets oneDNN reorder the weight into its blocked layout on
every call; reordering once at load time is measured here at 2x faster for one row (decode
of a single stream) and 20-30% faster at 32-64 rows. Where the CPU has AVX-512 and the
shape allows, hotpool's own kernel (``kernels/cpu_ops.c``, ``hp_linear``) runs instead
(``benchmarks/bench_linear.py``, 2 cores): with AVX-512 BF16 (Zen 4) 1.2-2x oneDNN's at
1-64 rows, level beyond; without it (an Ice Lake-class Xeon, float32 FMAs over widened
bf16) 1.9x at one row, 2.7-4.3x at 8-2048, where oneDNN's own emulation is slow;
the MLP's gate/up projection also applies its activation there (:class:`PackedGateUp`).
Either way one packed copy of the weight is kept, the same size as the original.
"""

from __future__ import annotations

import torch
from torch import nn

from hotpool.kernels import cpu_ops


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX-512 BF16, AMX or AVX-NE-CONVERT), as
    oneDNN sees it. Without it (an AVX2-only CPU) torch emulates bf16 matmuls element by
    element, ~8x slower than fp32 there, and oneDNN refuses to prepack bf16 weights."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and probe is not None and probe())


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and cpu_has_native_bf16()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """Inference-only stand-in for ``nn.Linear`` (2-D inputs ``[tokens, in_features]``)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        kernels = cpu_ops.load()
        self.kernels = (
            kernels if kernels is not None and kernels.linear_supported(*weight.shape) else None
        )
        if self.kernels is not None:
            self.packed = self.kernels.pack_linear(weight)
            # The kernel adds the bias in float32 before its one rounding, as oneDNN does.
            self.bias = None if linear.bias is None else linear.bias.detach().float()
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            self.bias = None if linear.bias is None else linear.bias.detach()

    @property
    def backend(self) -> str:
        return "native" if self.kernels is not None else "onednn"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.linear(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )


class PackedGateUp(PackedLinear):
    """The MLP's fused ``[gate | up]`` projection on hotpool's kernel, which can also apply
    the activation: :meth:`silu_mul` returns ``silu(gate) * up`` straight from the
    accumulators (bit for bit what ``silu_mul`` makes of :meth:`forward`'s output), saving a
    pass over ``[tokens, 2 I]`` and a kernel call per layer."""

    def __init__(self, linear: nn.Linear, kernels: cpu_ops.CpuOps) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels = kernels
        self.packed = kernels.pack_gate_up(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    @staticmethod
    def supported(linear: nn.Linear, kernels: cpu_ops.CpuOps) -> bool:
        out, k = linear.out_features, linear.in_features
        return kernels.linear_supported(out, k) and out % 32 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.gate_up(x, self.packed, self.bias, act=False)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.gate_up(x, self.packed, self.bias, act=True)


def pack_linears(model: nn.Module, gate_up: str = "feed_forward.w13") -> int:
    """Replace every ``nn.Linear`` in ``model`` by a :class:`PackedLinear` (a
    :class:`PackedGateUp` for the linears named ``gate_up`` where the kernel serves them);
    returns how many."""
    targets = [
        (parent, name, child, f"{parent_name}.{name}")
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    kernels = cpu_ops.load()
    for parent, name, child, path in targets:
        if (
            kernels is not None
            and path.endswith(gate_up)
            and PackedGateUp.supported(child, kernels)
        ):
            setattr(parent, name, PackedGateUp(child, kernels))
        else:
            setattr(parent, name, PackedLinear(child))
    return len(targets)
