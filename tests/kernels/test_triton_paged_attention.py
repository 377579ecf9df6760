"""Triton paged attention against the torch reference: compiled on CUDA, and in Triton's CPU
interpreter elsewhere (tests/kernels/conftest.py sets ``TRITON_INTERPRET=1`` without a GPU).

Cases are built on the CPU; ``_decode`` and ``_prefill`` run the kernels on ``DEVICE``.
Sliding-window cases are checked against a dense float64 reference with an explicit mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from dense_attention import dense_attention

from hotpool.kernels.paged_attention import paged_decode, paged_prefill
from hotpool.kernels.triton_paged_attention import (
    triton_paged_decode,
    triton_paged_prefill,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_device(kernel: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    return kernel(*moved).cpu()


def _decode(*args: Any) -> torch.Tensor:
    return _on_device(triton_paged_decode, *args)


def _prefill(*args: Any) -> torch.Tensor:
    return _on_device(triton_paged_prefill, *args)


NB, BS, D = 40, 16, 64
LENS = [1, 15, 16, 17, 33, 70]  # one token, partial, exactly full, one over, several blocks


def _cache(
    n_kv: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(n_kv, NB, BS, D, generator=gen).to(dtype)
    v = torch.randn(n_kv, NB, BS, D, generator=gen).to(dtype)
    return k, v


def _tables(lens: list[int], gen: torch.Generator, pad: int | None = None) -> torch.Tensor:
    """``[B, max_blocks]`` int64: each sequence in its own random, non-contiguous blocks,
    padded with random valid block ids (or ``pad``)."""
    perm = torch.randperm(NB, generator=gen)
    width = max(-(-n // BS) for n in lens)
    tables = torch.randint(0, NB, (len(lens), width), generator=gen)
    used = 0
    for i, n in enumerate(lens):
        blocks = -(-n // BS)
        tables[i, :blocks] = perm[used : used + blocks]
        if pad is not None:
            tables[i, blocks:] = pad
        used += blocks
    return tables


def _decode_case(
    n_heads: int, n_kv: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = _cache(n_kv, dtype, gen)
    q = torch.randn(len(LENS), n_heads, D, generator=gen).to(dtype)
    return q, k_cache, v_cache, _tables(LENS, gen), torch.tensor(LENS)


@pytest.mark.parametrize(("n_heads", "n_kv"), [(2, 2), (4, 2), (6, 2), (8, 1)])
def test_decode_matches_reference_in_fp32_for_gqa_ratios_1_2_3_8(n_heads: int, n_kv: int) -> None:
    args = _decode_case(n_heads, n_kv, torch.float32)
    out = _decode(*args)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    torch.testing.assert_close(out, paged_decode(*args), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_matches_reference_in_half_precision(dtype: torch.dtype) -> None:
    args = _decode_case(4, 2, dtype, seed=1)
    out = _decode(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out, paged_decode(*args), atol=3e-2, rtol=3e-2)


def test_decode_query_head_reads_kv_head_h_div_group() -> None:
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = _cache(2, torch.float32, gen)
    v_cache[0], v_cache[1] = 10.0, 20.0  # every value of KV head h is 10 * (h + 1)
    q = torch.randn(len(LENS), 6, D, generator=gen)
    out = _decode(q, k_cache, v_cache, _tables(LENS, gen), torch.tensor(LENS))
    expected = torch.tensor([10.0, 10.0, 10.0, 20.0, 20.0, 20.0])
    torch.testing.assert_close(out[:, :, 0], expected.expand(len(LENS), 6))


def test_decode_ignores_padding_entries_and_stale_slots_past_the_end() -> None:
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = _cache(2, torch.float32, gen)
    q = torch.randn(len(LENS), 4, D, generator=gen)
    clean = _tables(LENS, gen, pad=0)
    reference = paged_decode(q, k_cache, v_cache, clean, torch.tensor(LENS))
    poisoned = clean.clone()
    for i, n in enumerate(LENS):
        poisoned[i, -(-n // BS) :] = -1  # never dereferenced: only blocks with tokens are read
        # Garbage after the sequence's last token, in its partially filled last block.
        last = clean[i, (n - 1) // BS]
        k_cache[:, last, (n - 1) % BS + 1 :] = float("nan")
        v_cache[:, last, (n - 1) % BS + 1 :] = float("nan")
    out = _decode(q, k_cache, v_cache, poisoned, torch.tensor(LENS))
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


def test_decode_reads_strided_inputs() -> None:
    q, k_cache, v_cache, tables, lens = _decode_case(4, 2, torch.float32, seed=4)
    qkv = torch.cat([q, torch.randn_like(q)], dim=1)  # q as a view of a fused projection
    wide = torch.stack([tables, -tables], dim=2).flatten(1)[
        :, ::2
    ]  # a table with a column stride of 2
    lens32 = torch.stack([lens, -lens], dim=1).int()[:, 0]
    assert not qkv[:, :4].is_contiguous() and not wide.is_contiguous()
    out = _decode(qkv[:, :4], k_cache, v_cache, wide, lens32)
    torch.testing.assert_close(
        out, paged_decode(q, k_cache, v_cache, tables, lens), atol=1e-4, rtol=1e-4
    )


def _prefill_case(
    start: int, t: int, dtype: torch.dtype, n_heads: int = 4, n_kv: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    gen = torch.Generator().manual_seed(start * 100 + t)
    # The cache already holds the new tokens' K/V (written by write_kv before attention).
    k_cache, v_cache = _cache(n_kv, dtype, gen)
    table = _tables([start + t], gen)[0]
    q = torch.randn(t, n_heads, D, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, start


@pytest.mark.parametrize(("start", "t"), [(0, 1), (0, 21), (5, 33), (16, 16), (37, 20)])
def test_prefill_matches_reference_in_fp32(start: int, t: int) -> None:
    args = _prefill_case(start, t, torch.float32)
    out = _prefill(*args)
    torch.testing.assert_close(out, paged_prefill(*args), atol=1e-4, rtol=1e-4)


def test_prefill_matches_reference_with_gqa_ratio_3_in_bf16() -> None:
    args = _prefill_case(9, 19, torch.bfloat16, n_heads=6, n_kv=2)
    out = _prefill(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, paged_prefill(*args), atol=3e-2, rtol=3e-2)


def test_prefill_never_sees_keys_after_the_query_or_past_the_table_end() -> None:
    q, k_cache, v_cache, table, start = _prefill_case(3, 18, torch.float32)
    reference = paged_prefill(q, k_cache, v_cache, table, start)
    end = start + q.shape[0]
    last = table[(end - 1) // BS]
    k_cache[:, last, (end - 1) % BS + 1 :] = float("nan")
    v_cache[:, last, (end - 1) % BS + 1 :] = float("nan")
    padded = torch.cat([table, table.new_full((3,), -1)])  # unused trailing entries
    out = _prefill(q, k_cache, v_cache, padded, start)
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


_Q, _K, _V, _T, _L = _decode_case(4, 2, torch.float32)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: _decode(_Q.double(), _K, _V, _T, _L), "q dtype"),
        (lambda: _decode(_Q, _K.half(), _V, _T, _L), "share a dtype"),
        (lambda: _decode(_Q, _K[0], _V[0], _T, _L), "num_kv_heads, num_blocks"),
        (lambda: _decode(_Q[..., :32], _K[..., :32], _V[..., :32], _T, _L), "head_dim"),
        (lambda: _decode(_Q, _K[:, :, :8], _V[:, :, :8], _T, _L), "block_size"),
        (lambda: _decode(_Q[:, :3], _K, _V, _T, _L), "not a multiple"),
        (lambda: _decode(_Q, _K, _V, _T.int(), _L), "block_tables dtype"),
        (lambda: _decode(_Q, _K, _V, _T[:2], _L), "block_tables must be"),
        (lambda: _decode(_Q, _K, _V, _T, _L.float()), "seq_lens dtype"),
        (lambda: _decode(_Q, _K, _V, _T, _L[:2]), "seq_lens must be"),
        (lambda: _prefill(_Q, _K, _V, _T[0], -1), "start"),
        (lambda: _prefill(_Q, _K, _V, _T, 0), "1-D"),
        (lambda: _prefill(_Q, _K, _V, _T[0, :1], 20), "need 2"),
        (lambda: _decode(_Q, _K, _V, _T, _L, None, 0), "window must be a positive int"),
        (lambda: _decode(_Q, _K, _V, _T, _L, None, 2.5), "window must be a positive int"),
        (lambda: _prefill(_Q, _K, _V, _T[0], 0, -4), "window must be a positive int"),
        (lambda: _prefill(_Q, _K, _V, _T[0], 0, True), "window must be a positive int"),
    ],
)
def test_wrappers_reject_bad_inputs_with_a_clear_error(
    call: Callable[[], torch.Tensor], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_wrappers_reject_a_cache_not_dense_in_head_dim() -> None:
    # Strided where the kernel runs: moving a CPU view to a GPU would make it dense.
    k = torch.randn(2, NB, BS, D * 2, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        _decode(_Q, k, _V, _T, _L)


def _poisoned(
    lens: list[int], firsts: list[int], n_kv: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Caches where sequence b's tokens exist only at positions ``[firsts[b], lens[b])``:
    every other slot holds NaN, and table entries wholly before ``firsts[b]`` point at
    block 0, a placeholder full of NaN that every sequence shares. Returns the caches, the
    tables and each sequence's own (keys, values) ``[lens[b], Hkv, D]``."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // BS) for n in lens)
    nb = 1 + width * len(lens)
    k_cache = torch.full((n_kv, nb, BS, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = (1 + torch.randperm(nb - 1, generator=gen)).view(len(lens), width)
    own = []
    for b, (n, first) in enumerate(zip(lens, firsts, strict=True)):
        keys = torch.randn(n, n_kv, d, generator=gen).to(dtype)
        values = torch.randn(n, n_kv, d, generator=gen).to(dtype)
        for pos in range(first, n):
            block, row = tables[b, pos // BS], pos % BS
            k_cache[:, block, row], v_cache[:, block, row] = keys[pos], values[pos]
        tables[b, : first // BS] = 0
        own.append((keys, values))
    return k_cache, v_cache, tables, own


def _windowed_decode(
    window: int, n_heads: int, n_kv: int, d: int, dtype: torch.dtype, lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and the dense reference, for a batch of ``lens`` poisoned
    outside their windows."""
    firsts = [max(0, n - window) for n in lens]
    k_cache, v_cache, tables, own = _poisoned(lens, firsts, n_kv, d, dtype, seed=window + d)
    q = torch.randn(len(lens), n_heads, d, generator=torch.Generator().manual_seed(d)).to(dtype)
    out = _decode(q, k_cache, v_cache, tables, torch.tensor(lens), None, window)
    refs = [dense_attention(q[b : b + 1], *own[b], n - 1, window) for b, n in enumerate(lens)]
    return out, torch.cat(refs)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 100])
def test_decode_with_a_window_reads_only_the_window(window: int) -> None:
    """Windows shorter than, equal to and longer than the sequences (of several lengths in
    one batch), on and off block edges, GQA 8 query / 2 KV heads: NaN everywhere outside the
    windows (before them in the sequences' blocks, and in the placeholder block) never
    reaches the output."""
    out, ref = _windowed_decode(window, 8, 2, D, torch.float32, LENS)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("window", "dtype"), [(9, torch.float32), (33, torch.bfloat16)])
def test_decode_with_a_window_at_head_dim_256(window: int, dtype: torch.dtype) -> None:
    out, ref = _windowed_decode(window, 4, 2, 256, dtype, [1, 17, 33, 50])
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_decode_without_a_window_is_unchanged_by_a_window_past_every_length() -> None:
    args = _decode_case(4, 2, torch.float32, seed=5)
    torch.testing.assert_close(_decode(*args, None, max(LENS)), _decode(*args), atol=0, rtol=0)


def _windowed_prefill(
    start: int, t: int, window: int, n_heads: int, n_kv: int, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and the dense reference, for a chunk ``[start, start + t)``
    whose sequence is poisoned before token 0's window and past the chunk."""
    n = start + t
    k_cache, v_cache, (table,), ((keys, values),) = _poisoned(
        [n], [max(0, start + 1 - window)], n_kv, d, torch.float32, seed=start + t + window
    )
    q = torch.randn(t, n_heads, d, generator=torch.Generator().manual_seed(t))
    out = _prefill(q, k_cache, v_cache, table, start, window)
    return out, dense_attention(q, keys, values, start, window)


@pytest.mark.parametrize(
    ("start", "t", "window"),
    [
        (0, 21, 5),  # a first chunk, two query tiles
        (0, 16, 100),  # a window past every position
        (10, 11, 21),  # a window as long as the sequence
        (5, 33, 16),  # chunked prefill: windows equal to and
        (37, 20, 17),  # one past a block, skipping whole blocks
        (5, 33, 4),  # a tile's later rows see nothing in its first block
        (40, 3, 1),  # each token sees only itself
    ],
)
def test_prefill_with_a_window_reads_only_the_windows(start: int, t: int, window: int) -> None:
    out, ref = _windowed_prefill(start, t, window, 8, 2, D)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("start", "t", "window"), [(0, 18, 18), (19, 5, 7)])
def test_prefill_with_a_window_at_head_dim_256(start: int, t: int, window: int) -> None:
    out, ref = _windowed_prefill(start, t, window, 4, 2, 256)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
