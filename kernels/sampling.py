"""Turn a batch of logits into tokens: the sampler's public API, and the choice of path.

Each row carries its own parameters (``SamplingRow``). Every path applies them in this order:

1. **Penalties**, on the logits. Repetition (vLLM/HF): every token of the prompt or the
   output has a positive logit divided by ``repetition_penalty`` and a negative one
   multiplied. Then presence and frequency (OpenAI): over the output tokens,
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
1b. **Grammar mask** (``sample(..., token_bitmask=...)``, structured outputs): a token the
   row's bitmask disallows is sampled as if its penalized logit were -inf. Everything below
   sees only the allowed tokens, renormalized: min_p's largest probability, top_k's k-th,
   top_p's mass, the greedy argmax.
2. **Logprobs** are taken from the model's RAW logits: ``log_softmax`` before penalties, the
   mask and temperature, for the sampled token and the top-N (what OpenAI's API reports,
   and vLLM's default ``raw_logprobs``): a top-N may name tokens the mask disallows.
3. **Temperature**. Below 1e-5 (0 included), and with ``top_k == 1``, the row is greedy: the
   argmax of the penalized, masked logits (the lowest token id among equals), whatever its
   filters.
4. **min_p**: drop tokens whose probability is below ``min_p`` times the largest one.
5. **top_k**.
6. **top_p** over the survivors of 4-5, renormalized; the token that crosses ``top_p``
   stays in.
7. **Draw** one token from what is left, exactly in proportion to its probability.

Where tokens tie at a cut (equal to the k-th largest logit, or at the top-p crossing),
which of them stay differs by path: the reference keeps the lowest ids (a stable sort), the
torch code's sorts keep as many as the cut allows, in no set order, its rejection top-p and
the CPU's C sampler keep every token of the cut's weight, and the Triton kernel every token
of the cut's logit. Otherwise every path draws from the same distribution.

Paths (``sample(..., backend=...)``; None picks the Triton kernel for CUDA logits in
fp32/bf16/fp16 when triton imports, compiled rather than interpreted; the torch path
otherwise):

- ``"torch"`` (``sampling_torch``): on the CPU, one call of a C kernel samples the whole
  batch (``cpu_ops.hp_sample``: a thread per row, rejection top-p, no sort); where it does
  not load, and on other devices, batched torch (those sort top-p rows and never wait for
  the device until the results are copied to the host, once).
- ``"triton"`` (``triton_sampling``): one fused kernel, a few passes over each row, no
  sorted copy. Penalties are applied by torch before it; the sampled token's logprob comes
  from the kernel, or from torch when penalties changed the logits, and top-N logprobs from
  torch. Runs on the CPU under ``TRITON_INTERPRET=1`` (the tests).
- ``"reference"`` (``sampling_reference``): one row at a time in float64, sorting the whole
  vocabulary; slow and obviously correct, what the tests hold the others to.

Randomness. The torch and reference paths draw uniforms from the row's ``generator`` when
it has one; else, when it has a ``seed``, from a CPU generator seeded with ``(seed,
offset)``; else from torch's default generator. The Triton kernel draws two counter-based
Philox numbers from ``(seed, offset)`` per row: the row's own seed; else one drawn from its
``generator``; else one drawn from torch's default generator. Either way a
seeded row's tokens never depend on the rest of the batch, and on one path the same
``(seed, offset)`` gives the same token; the paths do not reproduce each other's tokens.
``offset`` is the number of tokens the request has generated so far, so each step of a
seeded request draws afresh. A row whose mask allows every token (all -1) gets the token it
would get without a mask, on every path.

The mask (``sampling_bitmask``) is llguidance's and xgrammar's layout: int32 ``[B, (V + 31)
// 32]``, bit ``j`` of word ``w`` allows token ``32 * w + j``, bits past V ignored. The
grammar engine fills it on the CPU; for CUDA logits it is copied to the device once per call
(without waiting, from pinned memory; the call waits for its results anyway, so the host
buffer is free to refill when ``sample`` returns). The C sampler and the Triton kernel test
the bits as they read the logits; the torch code and the reference unpack them.

Modules: ``sampling_types`` (``SamplingRow``, ``SamplerOutput``, ``NonFiniteLogitsError``,
re-exported here), ``sampling_penalties`` (step 1), ``sampling_random`` (the randomness
rules above), ``sampling_torch``, ``triton_sampling`` with ``sampling_pivot_search``,
``sampling_reference`` (the paths), ``sampling_transfer`` (host and device copies),
``sampling_bitmask`` (step 1b's mask: its checks, and unpacking it).

Errors. A row holding NaN or +inf, or no finite logit at all, has no distribution:
``sample`` raises ``NonFiniteLogitsError`` naming those rows, never returning a token for
them. The torch path finds them for free in the raw ``log_softmax`` it computes for
logprobs (on the CPU at once, elsewhere with the results); the Triton kernel marks them with
token -1, read after the one copy of the results to the host, where the call waits anyway.
Sampling such a row first is harmless: every path keeps its indices inside the row. A row
masked to -inf except for some tokens samples among those. So does a row whose bitmask
allows only some tokens; one whose allowed logits are all -inf (or that allows none) has no
distribution and raises ``NonFiniteLogitsError`` too; so does a row with NaN or +inf at a
token its mask disallows (the raw logprobs would be NaN).
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Sequence
from types import ModuleType

import torch

from hotpool.kernels.sampling_bitmask import check_bitmask
from hotpool.kernels.sampling_penalties import apply_penalties
from hotpool.kernels.sampling_random import row_generators
from hotpool.kernels.sampling_reference import reference_sample
from hotpool.kernels.sampling_torch import topk, torch_sample_tokens
from hotpool.kernels.sampling_transfer import kernel_params, to_device, to_host
from hotpool.kernels.sampling_types import NonFiniteLogitsError, SamplerOutput, SamplingRow

__all__ = ["BACKENDS", "NonFiniteLogitsError", "SamplerOutput", "SamplingRow", "sample"]

BACKENDS = ("torch", "triton", "reference")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    *,
    backend: str | None = None,
    token_bitmask: torch.Tensor | None = None,
) -> SamplerOutput:
    """Sample one token per row of ``logits`` ``[B, V]`` (floating point, any device); the
    results are on the CPU. ``backend``: ``"torch"``, ``"triton"``, ``"reference"``, or None
    to choose by device. ``token_bitmask``: the grammar's allowed tokens, int32 ``[B, (V +
    31) // 32]`` on the CPU (see above), or None. Raises ``NonFiniteLogitsError`` for rows
    with nothing to sample, ValueError for a malformed ``token_bitmask``."""
    if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] == 0:
        raise ValueError(f"logits {tuple(logits.shape)} are not [{len(rows)} rows, V > 0]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    mask = None
    if token_bitmask is not None:
        b, v = logits.shape
        mask = check_bitmask(token_bitmask, b, v).contiguous()
        if mask.device != logits.device:
            mask = to_device(mask.cpu(), logits.device)
    path = backend or _automatic(logits)
    if path == "reference":
        return reference_sample(logits, rows, mask)
    if path == "triton":
        out = _sample_triton(logits, rows, mask)
    else:
        out = _sample_torch(logits, rows, mask)
    bad = (out.token_ids < 0).nonzero().squeeze(1).tolist()
    if bad:
        raise NonFiniteLogitsError(bad)
    return out


def _automatic(logits: torch.Tensor) -> str:
    fits = logits.is_cuda and logits.dtype in _TRITON_DTYPES and logits.shape[0] > 0
    kernels = _triton_kernels() if fits else None
    # Under the interpreter (a test tool) the kernel takes CPU tensors only: CUDA logits
    # then go the torch way, and CPU logits always do.
    return "triton" if kernels is not None and not kernels.interpreted() else "torch"


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """``hotpool.kernels.triton_sampling``, or None when triton does not import (it is an
    optional dependency)."""
    try:
        return importlib.import_module("hotpool.kernels.triton_sampling")
    except ImportError:
        return None


def _sample_torch(
    logits: torch.Tensor, rows: Sequence[SamplingRow], mask: torch.Tensor | None
) -> SamplerOutput:
    raw = logits.float()
    # Penalties and the mask are applied there, to a copy (raw logits give the logprobs
    # below). A row without a distribution samples some in-range token, harmlessly: it is
    # found below for free and never returned (a masked one with nothing allowed: token -1).
    tokens = torch_sample_tokens(raw, rows, row_generators(rows), mask)
    n = _num_logprobs(rows, raw.shape[1])
    if n or any(r.logprob for r in rows):
        # log_softmax is NaN throughout a row with NaN or +inf, or with no finite logit, and
        # never NaN in any other row. Computed after sampling, it reuses the sampler's
        # buffers.
        raw_logprobs: torch.Tensor | None = torch.log_softmax(raw, dim=1)
        bad = raw_logprobs[:, 0].isnan()
    else:  # nobody reads a logprob: the row maximum finds those rows in one cheap pass
        raw_logprobs = None
        bad = ~torch.isfinite(raw.amax(dim=1))
    if mask is not None:
        bad |= tokens < 0
    if raw.device.type == "cpu":
        if bool(bad.any()):
            raise NonFiniteLogitsError(bad.nonzero().squeeze(1).tolist())
    else:  # reading it now would wait for the device: it travels with the results
        tokens = torch.where(bad, -1, tokens)
    if raw_logprobs is None:
        return to_host(tokens, torch.full_like(tokens, math.nan, dtype=torch.float32), None)
    return to_host(
        tokens,
        raw_logprobs.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1),
        topk(raw_logprobs, n) if n else None,
    )


def _sample_triton(
    logits: torch.Tensor, rows: Sequence[SamplingRow], mask: torch.Tensor | None
) -> SamplerOutput:
    kernels = _triton_kernels()
    if kernels is None:
        raise ValueError("backend 'triton' needs the triton package, which does not import")
    dev = logits.device
    penalized = any(r.has_penalty for r in rows)
    x = apply_penalties(logits, rows) if penalized else logits
    if x.dtype not in _TRITON_DTYPES:
        x = x.float()
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    k = kernel_params(rows, dev)
    # Known here, on the host: a batch without filters runs the kernel without their code.
    filters = any(r.top_k > 0 or r.top_p < 1.0 or r.min_p > 0.0 for r in rows)
    tokens, logprobs = kernels.triton_sample(
        x,
        k.temperature,
        k.top_k,
        k.top_p,
        k.min_p,
        k.seeds,
        k.offsets,
        filters=filters,
        token_bitmask=mask,
    )
    n = _num_logprobs(rows, logits.shape[1])
    top = None
    changed = penalized or mask is not None
    if changed or n:  # the kernel saw penalized, masked logits; logprobs are the raw ones'
        raw = logits.float()
        lse = torch.logsumexp(raw, dim=1, keepdim=True)
        if changed:
            logprobs = (raw.gather(1, tokens.clamp(min=0)[:, None]) - lse).squeeze(1)
        if mask is not None:  # the kernel saw no NaN or +inf at a disallowed token
            tokens = torch.where(lse.squeeze(1).isfinite(), tokens, -1)
        if n:
            values, ids = topk(raw, n)
            top = (values - lse, ids)
    return to_host(tokens, logprobs, top)


def _num_logprobs(rows: Sequence[SamplingRow], v: int) -> int:
    """How many top logprobs the batch needs: the most any row asked for, at most V."""
    return min(max((r.num_logprobs for r in rows), default=0), v)
