"""Paged attention (torch path) against naive attention over each sequence's own tokens,
with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from hotpool.kernels.paged_attention import (
    decode_key_bias,
    paged_decode,
    paged_prefill,
    write_kv,
)

NB, BS, H, HKV, D = 64, 4, 6, 2, 8


def _naive(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] at positions start.., keys/values [S, HKV, D]: causal softmax attention in
    float64, the mask built explicitly: query p sees keys k with p - window < k <= p."""
    rep = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1)
    v = values.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * q.shape[2] ** -0.5
    key_pos = torch.arange(keys.shape[0])[None, :]
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    allowed = key_pos <= q_pos
    if window is not None:
        allowed &= key_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.double()).float()


def _own(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A sequence's tokens in order, ``[S, HKV, D]``, read the slow obvious way."""
    return torch.cat([cache[:, b].transpose(0, 1) for b in table.tolist()])


def _sequences(
    lens: list[int], gen: torch.Generator, n_kv: int = HKV, d: int = D
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A cache holding each sequence's K/V in random, non-contiguous blocks."""
    k_cache = torch.randn(n_kv, NB, BS, d, generator=gen)
    v_cache = torch.randn(n_kv, NB, BS, d, generator=gen)
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


WINDOW_LENS = [1, 3, 4, 9, 16, 13]  # window 4 = a block; lengths both sides of each window


@pytest.mark.parametrize("window", [1, 3, 4, 6, 13, 16, 50])
@pytest.mark.parametrize(("n_heads", "n_kv", "d"), [(6, 2, 8), (8, 2, 8), (4, 2, 256)])
def test_decode_with_a_window_attends_only_the_last_window_keys(
    window: int, n_heads: int, n_kv: int, d: int
) -> None:
    """Windows shorter than, equal to and longer than the sequences, not aligned to blocks;
    the precomputed key bias the engine passes gives the same result."""
    gen = torch.Generator().manual_seed(window + d)
    k_cache, v_cache, tables = _sequences(WINDOW_LENS, gen, n_kv, d)
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    q = torch.randn(len(WINDOW_LENS), n_heads, d, generator=gen)
    lens = torch.tensor(WINDOW_LENS)
    out = paged_decode(q, k_cache, v_cache, padded, lens, window=window)
    for i, n in enumerate(WINDOW_LENS):
        keys, values = _own(k_cache, tables[i])[:n], _own(v_cache, tables[i])[:n]
        expected = _naive(q[i : i + 1], keys, values, n - 1, window)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)
    bias = decode_key_bias(lens, width * BS, window)
    assert torch.equal(paged_decode(q, k_cache, v_cache, padded, lens, bias), out)


def test_decode_key_bias_masks_keys_before_the_window_and_past_the_end() -> None:
    bias = decode_key_bias(torch.tensor([5, 2, 0]), 6, window=3)
    ninf = float("-inf")
    expected = torch.tensor(
        [[ninf, ninf, 0, 0, 0, ninf], [0, 0, ninf, ninf, ninf, ninf], [ninf] * 6]
    )
    assert torch.equal(bias, expected[:, None, :])
    assert torch.equal(
        decode_key_bias(torch.tensor([5]), 6), decode_key_bias(torch.tensor([5]), 6, 9)
    )


@pytest.mark.parametrize("start", [0, 5, 8, 13])
@pytest.mark.parametrize("window", [1, 4, 6, 7, 30])
def test_prefill_with_a_window_attends_each_token_s_own_window(start: int, window: int) -> None:
    """Chunked (start > 0) and first chunks; blocks wholly before the first token's window
    are not read, so their table entries may hold anything."""
    gen = torch.Generator().manual_seed(start * 100 + window)
    t = 6
    k_cache, v_cache, (table,) = _sequences([start + t], gen)
    q = torch.randn(t, H, D, generator=gen)
    keys, values = _own(k_cache, table), _own(v_cache, table)
    expected = _naive(q, keys[: start + t], values[: start + t], start, window)
    unread = table.clone()
    unread[: max(0, start + 1 - window) // BS] = NB + 1000  # not a block
    out = paged_prefill(q, k_cache, v_cache, unread, start, window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prefill_with_a_window_at_head_dim_256_and_gqa_4() -> None:
    gen = torch.Generator().manual_seed(256)
    start, t, window = 7, 9, 5
    k_cache, v_cache, (table,) = _sequences([start + t], gen, 2, 256)
    q = torch.randn(t, 8, 256, generator=gen)
    keys, values = _own(k_cache, table)[: start + t], _own(v_cache, table)[: start + t]
    out = paged_prefill(q, k_cache, v_cache, table, start, window=window)
    torch.testing.assert_close(out, _naive(q, keys, values, start, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, -3, True, 2.0, "4"])
def test_a_window_that_is_not_a_positive_int_is_rejected(window: object) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, (table,) = _sequences([5], gen)
    q = torch.randn(1, H, D, generator=gen)
    lens = torch.tensor([5])
    with pytest.raises(ValueError, match="window must be a positive int or None"):
        paged_decode(q, k_cache, v_cache, table[None], lens, window=window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window must be a positive int or None"):
        decode_key_bias(lens, 8, window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window must be a positive int or None"):
        paged_prefill(q, k_cache, v_cache, table, 4, window=window)  # type: ignore[arg-type]
