"""Paged attention (torch path) against naive attention over each sequence's own tokens."""

from __future__ import annotations

import pytest
import torch

from hotpool.kernels.paged_attention import paged_decode, paged_prefill, write_kv

NB, BS, H, HKV, D = 64, 4, 6, 2, 8


def _naive(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q [T, H, D] at positions start.., keys/values [S, HKV, D]: causal softmax attention."""
    rep = H // HKV
    k = keys.repeat_interleave(rep, dim=1)
    v = values.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * D**-0.5
    allowed = (
        torch.arange(keys.shape[0])[None, :] <= torch.arange(start, start + q.shape[0])[:, None]
    )
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.double()).float()


def _own(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A sequence's tokens in order, ``[S, HKV, D]``, read the slow obvious way."""
    return torch.cat([cache[:, b].transpose(0, 1) for b in table.tolist()])


def _sequences(
    lens: list[int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A cache holding each sequence's K/V in random, non-contiguous blocks."""
    k_cache = torch.randn(HKV, NB, BS, D, generator=gen)
    v_cache = torch.randn(HKV, NB, BS, D, generator=gen)
    perm = torch.randperm(NB, generator=gen)
    tables, used = [], 0
    for n in lens:
        blocks = -(-n // BS)
        tables.append(perm[used : used + blocks])
        used += blocks
    return k_cache, v_cache, tables


@pytest.mark.parametrize("lens", [[5], [1, 9, 16, 3], [7, 2, 13, 4, 11, 1, 8, 16, 5, 6]])
def test_decode_matches_naive_attention_in_both_batch_paths(lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(lens))
    k_cache, v_cache, tables = _sequences(lens, gen)
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    q = torch.randn(len(lens), H, D, generator=gen)
    out = paged_decode(q, k_cache, v_cache, padded, torch.tensor(lens))
    for i, n in enumerate(lens):
        keys = _own(k_cache, tables[i])[:n]
        values = _own(v_cache, tables[i])[:n]
        torch.testing.assert_close(
            out[i : i + 1], _naive(q[i : i + 1], keys, values, n - 1), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("start", [0, 5, 8])
def test_prefill_attends_to_the_cached_prefix_and_causally_to_itself(start: int) -> None:
    gen = torch.Generator().manual_seed(start)
    t = 6
    k_cache, v_cache, (table,) = _sequences([start + t], gen)
    k, v = torch.randn(t, HKV, D, generator=gen), torch.randn(t, HKV, D, generator=gen)
    positions = torch.arange(start, start + t)
    slots = table[positions // BS] * BS + positions % BS
    write_kv(k_cache, v_cache, k, v, slots)
    q = torch.randn(t, H, D, generator=gen)
    keys = _own(k_cache, table)[: start + t]
    values = _own(v_cache, table)[: start + t]
    torch.testing.assert_close(keys[start:], k)  # write_kv put them where the table says
    out = paged_prefill(q, k_cache, v_cache, table, start)
    torch.testing.assert_close(out, _naive(q, keys, values, start), atol=1e-5, rtol=1e-5)
