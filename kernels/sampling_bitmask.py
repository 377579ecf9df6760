"""The grammar's token bitmask (structured outputs): which tokens each row may sample.

The layout is llguidance's and xgrammar's: int32 ``[B, (V + 31) // 32]``, bit ``j`` of word
``w`` (``(mask[b, w] >> j) & 1``) allows token ``32 * w + j``; bits past V are ignored, and a
row of all -1 allows every token. The C sampler and the Triton kernel test the bits where
they read the logits; the torch code and the reference unpack them here.
"""

from __future__ import annotations

import torch


def bitmask_width(v: int) -> int:
    """Words per row of a bitmask over ``v`` tokens."""
    return (v + 31) // 32


def check_bitmask(mask: object, b: int, v: int) -> torch.Tensor:
    """``mask`` if it is a ``[b, (v + 31) // 32]`` int32 tensor, else a ValueError."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"token_bitmask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.int32:
        raise ValueError(f"token_bitmask must be int32, got {mask.dtype}")
    w = bitmask_width(v)
    if mask.dim() != 2 or tuple(mask.shape) != (b, w):
        raise ValueError(
            f"token_bitmask must be [{b} rows, {w} words] for {v} tokens "
            f"(one bit per token, 32 per int32), got {tuple(mask.shape)}"
        )
    return mask


def allowed_tokens(mask: torch.Tensor, v: int) -> torch.Tensor:
    """The bits of ``mask`` ``[B, W]`` as bool ``[B, v]``, on its device: shifts, no loop."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1  # an arithmetic shift: bit 31 is read right
    return bits.reshape(mask.shape[0], -1)[:, :v].bool()


def apply_bitmask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, V]`` with -inf where ``mask`` disallows the token (a new tensor)."""
    return x.masked_fill(~allowed_tokens(mask, x.shape[1]), float("-inf"))
