"""Attention over a paged KV cache: torch implementations (the CPU path and the reference).

The cache of one layer is ``k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim]``
(head-major: gathering a sequence's blocks yields ``[Hkv, S, D]`` per head with no
transpose, which is the layout the matmuls want). A sequence's tokens live in the blocks
its block table lists, in order; slot ``block * block_size + offset`` addresses a token.
Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA). The Triton
kernels in ``triton_paged_attention`` have the same signatures; the engine uses those on
CUDA (``worker/models/attention.py: attention_kernels``).

Sliding-window layers (Gemma 3, Mistral v0.1, Phi-3) pass ``window``, with HF transformers'
meaning: the query at position ``p`` attends the keys at ``p - window < k <= p``, the
``window`` most recent including its own; ``None`` is the whole causal context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's ``k``/``v`` ``[T, Hkv, D]`` at their slots."""
    n_kv, _, _, head_dim = k_cache.shape
    k_cache.view(n_kv, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(n_kv, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` (any shape, flattened) of every head: ``[Hkv, n * block_size, D]``."""
    n_kv, num_blocks, block_size, head_dim = cache.shape
    flat = block_ids.reshape(-1)
    out = cache.new_empty(n_kv, flat.numel(), block_size * head_dim)
    # One contiguous row gather per head: 2x faster than index_select along dim 1 here.
    for h in range(n_kv):
        torch.index_select(cache[h].view(num_blocks, -1), 0, flat, out=out[h])
    return out.view(n_kv, -1, head_dim)


def check_window(window: int | None) -> None:
    """Raise ValueError unless ``window`` is None or a positive int (a sliding window)."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int or None, got {window!r}")


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    key_bias: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``q [B, Hq, D]`` over ``seq_lens[b]`` cached tokens,
    or over the last ``window`` of them, ``[seq_lens[b] - window, seq_lens[b])``.

    ``block_tables [B, max_blocks]`` (padding entries, and with a window the entries wholly
    before it, may be any valid block id: they are masked). ``key_bias``
    (``[B, 1, max_blocks * block_size]`` fp32, 0 = attend, -inf = not) may be passed
    precomputed, since it is the same for every layer of a step; it is then used as given,
    so it must come from :func:`decode_key_bias` with the same ``window``.
    """
    check_window(window)
    b, n_heads, head_dim = q.shape
    n_kv, _, block_size, _ = k_cache.shape
    s = block_tables.shape[1] * block_size
    # [Hkv, B, S, D]: (KV head, sequence) pairs are one contiguous batch dimension, so the
    # batched matmuls below read the gathered keys and values in place.
    keys = gather(k_cache, block_tables).view(n_kv * b, s, head_dim)
    values = gather(v_cache, block_tables).view(n_kv * b, s, head_dim)
    if key_bias is None:
        key_bias = decode_key_bias(seq_lens, s, window)
    group = n_heads // n_kv
    qg = q.view(b, n_kv, group, head_dim).transpose(0, 1).reshape(n_kv * b, group, head_dim)
    scores = torch.bmm(qg, keys.transpose(1, 2)).view(n_kv, b, group, s)
    probs = torch.softmax(torch.add(key_bias, scores, alpha=head_dim**-0.5), dim=-1)
    out = torch.bmm(probs.to(q.dtype).view(n_kv * b, group, s), values)  # [Hkv * B, G, D]
    return out.view(n_kv, b, group, head_dim).transpose(0, 1).reshape(b, n_heads, head_dim)


def decode_key_bias(
    seq_lens: torch.Tensor, max_len: int, window: int | None = None
) -> torch.Tensor:
    """``[B, 1, max_len]`` fp32: 0 where a key is attended, -inf past each sequence's length
    and, with a ``window``, before its last ``window`` keys."""
    check_window(window)
    pos = torch.arange(max_len, device=seq_lens.device)[None, :]
    masked = pos >= seq_lens[:, None]
    if window is not None:
        masked |= pos < seq_lens[:, None] - window
    bias = torch.zeros(masked.shape, dtype=torch.float32, device=seq_lens.device)
    return bias.masked_fill_(masked, float("-inf"))[:, None, :]


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    window: int | None = None,
) -> torch.Tensor:
    """New tokens ``[start, start + T)`` of one sequence, ``q [T, Hq, D]``, attending causally
    to its cached prefix and to themselves (already written to the cache); with a
    ``window``, token ``i`` attends only keys ``(start + i - window, start + i]``."""
    check_window(window)
    t = q.shape[0]
    end = start + t
    if window is not None and window < end:
        return _windowed_prefill(q, k_cache, v_cache, block_table, start, window)
    keys = gather(k_cache, block_table)[:, :end]  # [Hkv, end, D]
    values = gather(v_cache, block_table)[:, :end]
    mask = None
    if start > 0:  # query i (position start + i) sees keys 0 .. start + i
        mask = (
            torch.arange(end, device=q.device)[None, :]
            <= torch.arange(start, end, device=q.device)[:, None]
        )
    return _sdpa(q, keys, values, mask, is_causal=start == 0)


def _windowed_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    window: int,
) -> torch.Tensor:
    t, block_size = q.shape[0], k_cache.shape[2]
    end = start + t
    # Blocks wholly before the first query's window are never gathered: their table entries
    # may point anywhere.
    first = max(0, start + 1 - window) // block_size
    blocks = block_table[first : -(-end // block_size)]
    offset = first * block_size
    keys = gather(k_cache, blocks)[:, : end - offset]
    values = gather(v_cache, blocks)[:, : end - offset]
    key_pos = torch.arange(offset, end, device=q.device)[None, :]
    q_pos = torch.arange(start, end, device=q.device)[:, None]
    mask = (key_pos <= q_pos) & (key_pos > q_pos - window)
    return _sdpa(q, keys, values, mask, is_causal=False)


def _sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
) -> torch.Tensor:
    """``q [T, Hq, D]`` over ``keys``/``values`` ``[Hkv, S, D]``, GQA, -> ``[T, Hq, D]``."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)
