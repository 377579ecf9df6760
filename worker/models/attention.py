"""The attention interface models are written against, and its two backends.

A model calls ``attn.forward(layer, q, k, v)`` once per layer with this step's new tokens;
the backend writes k/v into its cache and attends q over everything cached so far.
:class:`PagedAttention` is the engine's (a paged cache shared by a batch of sequences);
:class:`ContiguousAttention` keeps one sequence in one buffer, the obviously correct
reference that tests compare against.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hotpool.kernels import cpu_ops
from hotpool.kernels.paged_attention import (
    decode_key_bias,
    paged_decode,
    paged_prefill,
    write_kv,
)
from hotpool.worker.models import kv_memory


class Attention(ABC):
    """Per-step attention over a KV cache.

    Contract: ``q`` is ``[T, num_heads, head_dim]``, ``k`` and ``v`` are
    ``[T, num_kv_heads, head_dim]`` for the step's T new tokens (rotary already applied);
    the result is ``[T, num_heads, head_dim]``, causal over the cached context plus the new
    tokens. Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. With a
    ``window`` (a sliding-window layer), the query at position p sees only the keys at
    positions ``p - window < k <= p`` (HF's rule).
    """

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor: ...


class SequenceKVCache:
    """K and V for one sequence, preallocated for its whole lifetime: ``[layers, cap, H, D]``."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity


class ContiguousAttention(Attention):
    """Attention for one sequence whose tokens ``[start, start + T)`` are being computed."""

    def __init__(self, cache: SequenceKVCache, start: int, num_tokens: int) -> None:
        if start + num_tokens > cache.capacity:
            raise ValueError(
                f"KV cache holds {cache.capacity} tokens, step needs {start + num_tokens}"
            )
        self.cache = cache
        self.start = start
        self.end = start + num_tokens

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        self.cache.k[layer, self.start : self.end] = k
        self.cache.v[layer, self.start : self.end] = v
        keys = self.cache.k[layer, : self.end]
        values = self.cache.v[layer, : self.end]
        if window is not None:
            return _windowed(q, keys, values, self.start, window)
        if q.shape[0] == 1:
            return _decode_one(q, keys, values)
        return _prefill(q, keys, values, self.start)


def _decode_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    # One query token: two batched matmuls per KV-head group beat SDPA on CPU (PERF_NOTES).
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = keys.shape[1]
    qg = q.reshape(n_kv, n_heads // n_kv, head_dim)  # [Hkv, G, D]
    scores = torch.bmm(qg, keys.permute(1, 2, 0)) * (head_dim**-0.5)  # [Hkv, G, S]
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.bmm(probs, values.transpose(0, 1))  # [Hkv, G, D]
    return out.reshape(1, n_heads, head_dim)


def _prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    t, s = q.shape[0], keys.shape[0]
    mask = None
    if start > 0:  # new tokens after a cached prefix: token i sees positions <= start + i
        cols = torch.arange(s, device=q.device)
        rows = torch.arange(start, start + t, device=q.device)
        mask = cols[None, :] <= rows[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=start == 0,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def _windowed(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int
) -> torch.Tensor:
    """The obvious sliding-window attention: an explicit mask, position p sees (p - w, p]."""
    t, s = q.shape[0], keys.shape[0]
    cols = torch.arange(s, device=q.device)[None, :]
    rows = torch.arange(start, start + t, device=q.device)[:, None]
    mask = (cols <= rows) & (cols > rows - window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


class PagedKVCache:
    """Preallocated K and V of every layer: ``[num_kv_heads, num_blocks, block_size, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layer_slots: Sequence[int] | None = None,
    ) -> None:
        """``layer_slots`` (per layer; default: layer i in slot i) lets layers of different
        groups share a slot of every page, each group using its own pages of it (the hybrid
        layout of ``worker.engine.kv_groups``); the cache holds ``max(slots) + 1`` slots."""
        slots = list(range(num_layers)) if layer_slots is None else list(layer_slots)
        if len(slots) != num_layers or min(slots, default=0) < 0:
            raise ValueError(f"give one non-negative slot per layer, got {slots}")
        num_slots = max(slots, default=-1) + 1
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        # One allocation for every slot's K and V, viewed per layer. On the CPU it is
        # zeroed lazily, in huge pages, and faulted in by a background thread
        # (``kv_memory``): ``populated`` is set once that is over.
        self.populated = threading.Event()
        if torch.device(device).type == "cpu":
            self.storage = kv_memory.zeros((2, num_slots, *shape), dtype)
            self.populated = kv_memory.populate_in_background(self.storage)
        else:
            self.storage = torch.zeros((2, num_slots, *shape), dtype=dtype, device=device)
            self.populated.set()
        self.k = [self.storage[0, s] for s in slots]
        self.v = [self.storage[1, s] for s in slots]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's chunk of new tokens inside the flat batch."""

    q_start: int  # row of its first token in the flat batch
    num_tokens: int
    start: int  # position of its first token (= tokens already cached)
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """What one step's attention needs, built once per step by the model runner.

    The flat batch holds the decode tokens first (one per sequence), then the prefill chunks.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor  # [num_decodes]
    decode_key_bias: torch.Tensor | None  # [num_decodes, 1, max_blocks * block_size] fp32
    prefills: tuple[PrefillSpan, ...]


class PagedAttention(Attention):
    """The engine's attention: new K/V into the paged cache, then decode and prefill parts."""

    def __init__(
        self,
        cache: PagedKVCache,
        meta: PagedAttentionMetadata | Sequence[PagedAttentionMetadata],
        kernels: AttentionKernels | None = None,
        layer_group: Sequence[int] = (),
    ) -> None:
        """``meta`` is one metadata per layer group (or the one of a one-group model);
        ``layer_group`` says which each layer reads (default: group 0)."""
        self.cache = cache
        self.metas = (meta,) if isinstance(meta, PagedAttentionMetadata) else tuple(meta)
        self.layer_group = tuple(layer_group)
        self.kernels = kernels or attention_kernels(cache.k[0])
        # The decode key bias of each window this step's layers use, built on first use:
        # one per step for a model, as the metadata's own (window None) is. Every group's
        # tables are as wide (they span the same positions), so one per window serves all.
        self._key_bias: dict[int, torch.Tensor] = {}

    @property
    def meta(self) -> PagedAttentionMetadata:
        return self.metas[0]

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        m = self.metas[self.layer_group[layer]] if self.layer_group else self.metas[0]
        kern = self.kernels
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        kern.write_kv(k_cache, v_cache, k, v, m.slot_mapping)
        bias = self._decode_bias(m, window)
        tables, lens = m.decode_block_tables, m.decode_seq_lens
        if not m.prefills:
            return kern.decode(q, k_cache, v_cache, tables, lens, bias, window=window)
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides
        if m.num_decodes:
            out[: m.num_decodes] = kern.decode(
                q[: m.num_decodes], k_cache, v_cache, tables, lens, bias, window=window
            )
        for p in m.prefills:
            rows = slice(p.q_start, p.q_start + p.num_tokens)
            out[rows] = kern.prefill(
                q[rows], k_cache, v_cache, p.block_table, p.start, window=window
            )
        return out

    def _decode_bias(self, m: PagedAttentionMetadata, window: int | None) -> torch.Tensor | None:
        if window is None or m.decode_key_bias is None:
            return m.decode_key_bias
        bias = self._key_bias.get(window)
        if bias is None:
            width = m.decode_key_bias.shape[-1]
            bias = self._key_bias[window] = decode_key_bias(m.decode_seq_lens, width, window)
        return bias


@dataclass(frozen=True)
class AttentionKernels:
    """One implementation of the three steps of paged attention, with the signatures of
    ``hotpool.kernels.paged_attention``."""

    name: str
    write_kv: Callable[..., None]
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., torch.Tensor]
    needs_key_bias: bool  # whether decode reads the metadata's precomputed key bias


TORCH_KERNELS = AttentionKernels("torch", write_kv, paged_decode, paged_prefill, True)


def attention_kernels(
    cache: torch.Tensor, native: bool = True, backend: str | None = None
) -> AttentionKernels:
    """The kernels for a cache. ``backend`` None chooses: Triton on CUDA where it supports the
    shape, the fused C kernels for bfloat16 on the CPU (``native``, when they build), else
    torch. ``"torch"``, ``"native"`` or ``"triton"`` force one (Triton also runs on CPU
    tensors under ``TRITON_INTERPRET=1``, which is how tests compare the paths)."""
    if backend not in (None, "torch", "native", "triton"):
        raise ValueError(f"attention backend {backend!r}: choose torch, native or triton")
    _, _, block_size, head_dim = cache.shape
    if backend == "torch":
        return TORCH_KERNELS
    if backend == "triton" or (backend is None and cache.is_cuda):
        from hotpool.kernels import triton_paged_attention as tk  # triton only where it runs

        supported = block_size in tk.SUPPORTED_BLOCK_SIZES and head_dim in tk.SUPPORTED_HEAD_DIMS
        if supported:
            return AttentionKernels(
                "triton", write_kv, tk.triton_paged_decode, tk.triton_paged_prefill, False
            )
        if backend == "triton":
            raise ValueError(f"no Triton kernel for block size {block_size}, head dim {head_dim}")
    elif backend == "native" or (backend is None and native and cache.dtype == torch.bfloat16):
        ops = cpu_ops.load() if cache.dtype == torch.bfloat16 and not cache.is_cuda else None
        if ops is not None:
            # The C kernel reads the sequence lengths; it needs no key bias.
            decode = functools.partial(_without_key_bias, ops.paged_decode)
            prefill = functools.partial(_short_prefill_as_decodes, ops.paged_decode)
            return AttentionKernels("native", ops.write_kv, decode, prefill, False)
        if backend == "native":
            raise ValueError("the native kernels need a bfloat16 CPU cache and a C compiler")
    return TORCH_KERNELS


# Up to this many (query, key) pairs, a prefill chunk runs as one decode row per token (its
# key count growing by one each row): measured 1.4-3.7x faster than gather + SDPA for chunks
# of 16-132 tokens, even at ~60k pairs, slower beyond (SDPA's tiled matmuls reuse each key
# across queries; the decode kernel reads it once per query).
SHORT_PREFILL_PAIRS = 32768


def _short_prefill_as_decodes(
    decode: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    window: int | None = None,
) -> torch.Tensor:
    """``paged_prefill``'s function: token i of the chunk attends to ``start + i + 1`` keys
    (the last ``window`` of them: as a decode row, each token's window applies by itself)."""
    t = q.shape[0]
    keys = start + t if window is None else min(start + t, window)  # the most a row reads
    if t * keys > SHORT_PREFILL_PAIRS:
        return paged_prefill(q, k_cache, v_cache, block_table, start, window)
    tables = block_table.expand(t, -1).contiguous()
    seq_lens = torch.arange(start + 1, start + t + 1, device=q.device)
    return decode(q, k_cache, v_cache, tables, seq_lens, window=window)


def _without_key_bias(
    kernel: Callable[..., torch.Tensor],
    *args: torch.Tensor,
    key_bias: object = None,
    window: int | None = None,
) -> torch.Tensor:
    return kernel(*args[:5], window=window)
