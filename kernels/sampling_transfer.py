"""Moving the sampler's small tensors between host and device without waiting for the device
more than once per call: parameters go up asynchronously, results come back in one copy."""

from __future__ import annotations

import torch

from hotpool.kernels.sampling_types import SamplerOutput


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
