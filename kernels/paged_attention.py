"""Attention over a paged KV cache: torch implementations (the CPU path and the reference).

The cache of one layer is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``;
a sequence's tokens live in the blocks its block table lists, in order. Query head ``h``
reads KV head ``h // (num_heads // num_kv_heads)`` (GQA). The Triton kernels of issue 4 will
sit beside these with the same signatures.
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
    """Store this step's ``k``/``v`` ``[T, Hkv, D]`` at flat slots: block * block_size + offset."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``q [B, Hq, D]`` over ``seq_lens[b]`` cached tokens.

    ``block_tables [B, max_blocks]`` (padding entries may be any valid block id: they are
    masked). ``key_bias`` (``[B, 1, max_blocks * block_size]`` fp32, 0 = attend, -inf = not)
    may be passed precomputed, since it is the same for every layer of a step.
    """
    b, n_heads, head_dim = q.shape
    num_blocks, block_size, n_kv, _ = k_cache.shape
    s = block_tables.shape[1] * block_size
    # index_select on whole blocks is ~5x faster than advanced indexing on this CPU.
    flat = block_tables.reshape(-1)
    keys = k_cache.view(num_blocks, -1).index_select(0, flat).view(b, s, n_kv, head_dim)
    values = v_cache.view(num_blocks, -1).index_select(0, flat).view(b, s, n_kv, head_dim)
    if key_bias is None:
        key_bias = decode_key_bias(seq_lens, s)
    # Query heads grouped by KV head, two matmuls with a softmax between: faster here than
    # SDPA with one query, and than one bmm per KV head (measured: bf16 bmm copies strided
    # inputs anyway).
    qg = q.reshape(b, n_kv, n_heads // n_kv, head_dim)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1))  # [B, Hkv, G, S]
    probs = torch.softmax(torch.add(key_bias[:, None], scores, alpha=head_dim**-0.5), dim=-1)
    return torch.matmul(probs.to(q.dtype), values.transpose(1, 2)).reshape(b, n_heads, head_dim)


def decode_key_bias(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[B, 1, max_len]`` fp32: 0 where a key exists, -inf past each sequence's length."""
    pad = torch.arange(max_len, device=seq_lens.device)[None, :] >= seq_lens[:, None]
    bias = torch.zeros(pad.shape, dtype=torch.float32, device=seq_lens.device)
    return bias.masked_fill_(pad, float("-inf"))[:, None, :]


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """New tokens ``[start, start + T)`` of one sequence, ``q [T, Hq, D]``, attending causally
    to its cached prefix and to themselves (already written to the cache)."""
    t, _, head_dim = q.shape
    end = start + t
    n_kv = k_cache.shape[2]
    nb = k_cache.shape[0]
    keys = k_cache.view(nb, -1).index_select(0, block_table).view(-1, n_kv, head_dim)[:end]
    values = v_cache.view(nb, -1).index_select(0, block_table).view(-1, n_kv, head_dim)[:end]
    mask = None
    if start > 0:  # query i (position start + i) sees keys 0 .. start + i
        mask = (
            torch.arange(end, device=q.device)[None, :]
            <= torch.arange(start, end, device=q.device)[:, None]
        )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=start == 0,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)
