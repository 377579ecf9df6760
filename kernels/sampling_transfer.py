"""Moving the sampler's small tensors between host and device without waiting for the device
more than once per call: parameters go up asynchronously, results come back in one copy."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hotpool.kernels.sampling_random import philox_seeds
from hotpool.kernels.sampling_types import SamplerOutput, SamplingRow

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class KernelParams:
    """Each row's sampling parameters as the Triton kernel reads them, on its device."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int32 (0 = off; clamped to int32)
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64 Philox keys
    offsets: torch.Tensor  # [B] int64 Philox counters (tokens drawn so far)


def kernel_params(rows: Sequence[SamplingRow], dev: torch.device) -> KernelParams:
    """One host buffer, one copy to the device, six views of it. Building it with ``array``
    (C loops over Python numbers) rather than ``torch.tensor`` of lists, and copying once
    rather than six times, keeps this off the step's critical path at large batch."""
    b = len(rows)
    # Each of the six parts starts on a 16-byte boundary (b rounded up to 4 elements), as
    # Triton specialises kernels on pointer alignment: one compiled variant, not one per
    # batch size modulo 4.
    n = -(-b // 4) * 4
    pad = [0] * (n - b)
    seeds, offsets = philox_seeds(rows)
    ints = array("q", seeds + pad + offsets + pad)
    floats = array("f", [r.temperature for r in rows] + pad)
    floats.extend([r.top_p for r in rows] + pad)
    floats.extend([r.min_p for r in rows] + pad)
    top_k = array("i", [r.top_k if r.top_k < _INT32_MAX else _INT32_MAX for r in rows])
    host = torch.frombuffer(
        bytearray(ints.tobytes() + floats.tobytes() + top_k.tobytes()), dtype=torch.uint8
    )
    buf = to_device(host, dev)
    i64 = buf[: 16 * n].view(torch.int64)
    f32 = buf[16 * n : 28 * n].view(torch.float32)
    return KernelParams(
        temperature=f32[:b],
        top_k=buf[28 * n :].view(torch.int32),
        top_p=f32[n : n + b],
        min_p=f32[2 * n : 2 * n + b],
        seeds=i64[:b],
        offsets=i64[n : n + b],
    )


def to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    if dev.type == "cpu":
        return t
    # Pinned memory lets the copy run asynchronously instead of waiting for the device.
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


def to_host(
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    top: tuple[torch.Tensor, torch.Tensor] | None,
) -> SamplerOutput:
    """The results on the CPU, through a single device-to-host copy."""
    if tokens.device.type == "cpu":
        return SamplerOutput(tokens, logprobs, top)
    return unpack(pack(tokens, logprobs, top).cpu(), 0 if top is None else top[0].shape[1])


def pack(
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    top: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Every result in one int64 tensor, float32s by their bits, for a single host copy."""
    parts = [tokens[:, None], logprobs.view(torch.int32).long()[:, None]]
    if top is not None:
        parts += [top[0].contiguous().view(torch.int32).long(), top[1]]
    return torch.cat(parts, dim=1)


def unpack(packed: torch.Tensor, n: int) -> SamplerOutput:
    def floats(cols: torch.Tensor) -> torch.Tensor:
        return cols.to(torch.int32).contiguous().view(torch.float32)

    top = (floats(packed[:, 2 : 2 + n]), packed[:, 2 + n :].contiguous()) if n else None
    return SamplerOutput(packed[:, 0].contiguous(), floats(packed[:, 1]), top)
