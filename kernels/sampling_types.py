"""The types every sampling path shares: a row's parameters, the batch's result, the error for
logits that hold no distribution. ``hotpool.kernels.sampling`` re-exports them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Temperatures below this are greedy, as in vLLM: the distribution is the argmax's to within
# float precision, and dividing by them can overflow.
GREEDY_BELOW = 1e-5
_SEED_RANGE = (-(2**63), 2**64)


@dataclass(frozen=True)
class SamplingRow:
    """One request's sampling parameters for one step.

    A row is seeded by ``seed`` (with ``offset``, the number of tokens the request has
    generated so far) or by ``generator``, or not at all; see ``hotpool.kernels.sampling``
    for how each path turns them into random numbers.
    """

    temperature: float = 1.0  # 0 (below 1e-5): greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    generator: torch.Generator | None = None  # a CPU generator for seeded requests
    num_logprobs: int = 0  # top-N logprobs wanted at the sampled position
    # The sampled token's own logprob. Where no row of a batch wants either, the torch path
    # skips the log-softmax over the vocabulary (the costliest part of a greedy step on a
    # CPU) and these rows' logprobs come back NaN.
    logprob: bool = True
    prompt_token_ids: Sequence[int] = ()  # for repetition_penalty
    output_token_ids: Sequence[int] = ()  # for every penalty
    seed: int | None = None  # the request's seed: the draw is a function of (seed, offset)
    offset: int = 0  # tokens the request has generated so far

    def __post_init__(self) -> None:
        # `not x >= 0` also catches NaN.
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not (math.isfinite(self.presence_penalty) and math.isfinite(self.frequency_penalty)):
            raise ValueError("presence_penalty and frequency_penalty must be finite")
        if self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be >= 0, got {self.num_logprobs}")
        if self.generator is not None and self.generator.device.type != "cpu":
            raise ValueError("generator must be a CPU torch.Generator")
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if not 0 <= self.offset < 2**62:
            raise ValueError(f"offset must be >= 0, got {self.offset}")

    def with_offset(self, offset: int) -> SamplingRow:
        """This row at another offset (the next step of the same request). A copy that skips
        the checks this row already passed: the engine builds each request's row once, then
        one of these per step, at a fraction of a constructor's cost (measured 2.4 -> 0.5 us
        a row; 256 rows a step)."""
        if not 0 <= offset < 2**62:
            raise ValueError(f"offset must be >= 0, got {offset}")
        row = object.__new__(type(self))
        row.__dict__.update(self.__dict__)  # frozen: setattr is refused, the dict is not
        row.__dict__["offset"] = offset
        return row

    @property
    def has_penalty(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


@dataclass(frozen=True)
class SamplerOutput:
    """What ``sample`` returns, on the CPU."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: raw logprob of the sampled token
    # ([B, N] float32 raw logprobs sorted descending, [B, N] int64 ids) for N = the largest
    # num_logprobs in the batch (at most V), or None when no row asked.
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None


class NonFiniteLogitsError(ValueError):
    """Some rows of the logits hold NaN or +inf, or no finite value: no distribution to
    sample from (a numerical fault upstream, in the model or in a logits processor)."""

    def __init__(self, rows: Sequence[int]) -> None:
        self.rows: tuple[int, ...] = tuple(rows)
        shown = ", ".join(map(str, self.rows[:16])) + (", ..." if len(self.rows) > 16 else "")
        super().__init__(
            f"logits rows [{shown}] hold NaN or +inf, or no finite value: nothing to sample"
        )

    def __reduce__(self) -> tuple[type[NonFiniteLogitsError], tuple[tuple[int, ...]]]:
        return type(self), (self.rows,)
