"""The fused C kernels (kernels/cpu_ops.c) against torch computations of the same functions.

Element-wise kernels must round where HF's bfloat16 modules round: RoPE and the KV write
are exact; RMSNorm and SiLU may differ by one bfloat16 step where a float32 sum or exp is
computed in another order. Decode attention is compared with a float64 reference, with and
without a sliding window.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cpu_flags import target_flags
from dense_attention import dense_attention

from hotpool.kernels import cpu_ops
from hotpool.kernels.paged_attention import paged_decode, paged_prefill, write_kv
from hotpool.worker.models import attention

BF16_STEP = 2**-7  # relative distance between neighbouring bfloat16 values (at most)
X86 = platform.machine() in ("x86_64", "AMD64")
# What CPUs without AVX-512 build (AVX2), or this machine's own code elsewhere.
PORTABLE_MARCH = "x86-64-v3" if X86 else "native"


@pytest.fixture(scope="module")
def ops() -> cpu_ops.CpuOps:
    kernels = cpu_ops.load()
    if kernels is None:  # the suite runs where a C compiler exists (CI does)
        pytest.fail("the CPU kernels did not build; see the warning logged by cpu_ops.load")
    return kernels


@pytest.fixture(scope="module")
def portable_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one fresh build (a compile takes seconds: the tests share it)."""
    folder = tmp_path_factory.mktemp("kernel-build")
    cpu_ops.build(folder, march=PORTABLE_MARCH)
    return folder


def _bf16(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def _close_to_one_step(ours: torch.Tensor, ref: torch.Tensor, exact_share: float) -> None:
    torch.testing.assert_close(ours.float(), ref.float(), rtol=BF16_STEP, atol=1e-6)
    share = (ours == ref).float().mean().item()
    assert share >= exact_share, f"only {share:.3f} of elements are bit-identical"


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_add_rms_norm_is_hf_residual_add_then_rmsnorm(ops: cpu_ops.CpuOps, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, residual = _bf16(rows, 576, gen=gen), _bf16(rows, 576, gen=gen, scale=3.0)
    weight = _bf16(576, gen=gen)
    expected_residual = residual + x
    h = expected_residual.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    expected = weight * normed.to(torch.bfloat16)  # LlamaRMSNorm, in bfloat16

    out = ops.add_rms_norm(x, residual, weight, 1e-5)

    assert torch.equal(residual, expected_residual)  # updated in place, rounded like HF
    _close_to_one_step(out, expected, exact_share=0.99)


def test_rms_norm_without_an_add_leaves_the_residual(ops: cpu_ops.CpuOps) -> None:
    gen = torch.Generator().manual_seed(0)
    residual, weight = _bf16(3, 64, gen=gen), _bf16(64, gen=gen)
    before = residual.clone()
    out = ops.add_rms_norm(None, residual, weight, 1e-6)
    assert torch.equal(residual, before)
    ref = F.rms_norm(residual.float(), (64,), weight.float(), 1e-6)
    torch.testing.assert_close(out.float(), ref, rtol=2 * BF16_STEP, atol=1e-6)


def test_embed_add_and_widen_are_torch_bit_for_bit(ops: cpu_ops.CpuOps) -> None:
    """The three steps of a forward that were torch ops (the embedding lookup, the last
    residual add, the logits' widening) as kernels, so a kernel program can replay them."""
    gen = torch.Generator().manual_seed(4)
    table = _bf16(50, 24, gen=gen)
    ids = torch.tensor([3, 0, 49, 3], dtype=torch.long)
    assert torch.equal(ops.embed(table, ids), F.embedding(ids, table))
    with pytest.raises(IndexError, match=r"1 token id\(s\) outside the vocabulary \[0, 50\)"):
        ops.embed(table, torch.tensor([2, 50]))
    with pytest.raises(IndexError, match="outside"):
        ops.embed(table, torch.tensor([-1]))
    x, y = _bf16(5, 24, gen=gen, scale=100.0), _bf16(5, 24, gen=gen)
    expect = x.clone().add_(y)
    ops.add_(x, y)
    assert torch.equal(x, expect)
    with pytest.raises(ValueError, match="differ"):
        ops.add_(x, y[:4])
    assert torch.equal(ops.widen(x), x.float())
    with pytest.raises(ValueError, match="bfloat16"):
        ops.widen(x.float())


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_silu_mul_is_hf_llama_mlp_activation(ops: cpu_ops.CpuOps, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = _bf16(rows, 2 * 1536, gen=gen, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    _close_to_one_step(ops.silu_mul(gate_up), F.silu(gate) * up, exact_share=0.99)


def test_silu_mul_saturates_cleanly_on_extreme_gates(ops: cpu_ops.CpuOps) -> None:
    gate = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1e4]], dtype=torch.bfloat16)
    out = ops.silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), F.silu(gate.float()), rtol=BF16_STEP, atol=1e-6)


@pytest.mark.parametrize("d", [64, 256])  # 256: Gemma 3
def test_rope_matches_hf_rotate_half_in_bf16_and_leaves_v_alone(
    ops: cpu_ops.CpuOps, d: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    t, nq, nkv, max_pos = 9, 6, 2, 300
    qkv = _bf16(t, nq + 2 * nkv, d, gen=gen)
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    signed_sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(torch.bfloat16)

    x = qkv[:, : nq + nkv]
    c, s = cos[positions, None], sin[positions, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    expected = x * c + rotated * s  # HF's apply_rotary_pos_emb, each op rounded to bf16
    v_before = qkv[:, nq + nkv :].clone()

    ops.rope_(qkv, nq + nkv, positions, cos, signed_sin)

    assert torch.equal(qkv[:, : nq + nkv], expected)
    assert torch.equal(qkv[:, nq + nkv :], v_before)


@pytest.mark.parametrize("d", [64, 256])
def test_write_kv_stores_what_the_torch_path_stores(ops: cpu_ops.CpuOps, d: int) -> None:
    gen = torch.Generator().manual_seed(0)
    n_kv, nb, bs, t = 3, 10, 16, 7
    qkv = _bf16(t, 5 + 2 * n_kv, d, gen=gen)  # k and v as strided views, as in the model
    k, v = qkv[:, 5 : 5 + n_kv], qkv[:, 5 + n_kv :]
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    ours = [torch.zeros(n_kv, nb, bs, d, dtype=torch.bfloat16) for _ in range(2)]
    ref = [torch.zeros_like(ours[0]) for _ in range(2)]
    ops.write_kv(ours[0], ours[1], k, v, slots)
    write_kv(ref[0], ref[1], k, v, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def _paged_case(
    lens: list[int], n_heads: int, n_kv: int, block_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    d = 64
    width = max(-(-n // block_size) for n in lens)
    nb = width * len(lens) + 3
    k_cache, v_cache = (
        _bf16(n_kv, nb, block_size, d, gen=gen),
        _bf16(n_kv, nb, block_size, d, gen=gen),
    )
    perm = torch.randperm(nb, generator=gen)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens):
        blocks = -(-n // block_size)
        tables[i, :blocks] = perm[used : used + blocks]
        used += blocks
    q = _bf16(len(lens), n_heads, d, gen=gen, scale=2.0)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_decode_matches_the_torch_path(
    ops: cpu_ops.CpuOps, group: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    lens = [1, 17, 33, 100, 7]  # a single token, partial last blocks, odd lengths
    q, k_cache, v_cache, tables, seq_lens = _paged_case(lens, 2 * group, 2, block_size, gen)
    ours = ops.paged_decode(q, k_cache, v_cache, tables, seq_lens)
    ref = paged_decode(
        q.double(), k_cache.double(), v_cache.double(), tables, seq_lens
    )  # float64: the exact function
    torch.testing.assert_close(ours.double(), ref, rtol=2 * BF16_STEP, atol=2e-3)


# Shapes with a vector kernel of their own (dims 64 and 128, groups up to 8: accumulators in
# registers) and shapes that take the portable task.
@pytest.mark.parametrize(
    ("block_size", "dim", "group"),
    [(16, 64, 3), (16, 64, 8), (32, 128, 4), (16, 128, 1), (16, 128, 8), (16, 32, 1), (16, 96, 2)],
)
def test_paged_decode_matches_float64_and_ignores_stale_slots(
    ops: cpu_ops.CpuOps, block_size: int, dim: int, group: int
) -> None:
    """Both decode paths (AVX-512 for block sizes in 16s, dims 64 and 128): lengths that end
    mid-chunk, on a chunk edge, past a block edge; slots past each sequence's end hold NaN
    and infinities, as a reused block's stale rows may, and must not reach the output."""
    gen = torch.Generator().manual_seed(dim + group)
    lens = [1, 15, 16, 17, block_size + 3, 5 * block_size]
    n_kv = 2
    width = max(-(-n // block_size) for n in lens)
    nb = width * len(lens)
    k_cache = torch.full((n_kv, nb, block_size, dim), float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, float("inf"))
    tables = torch.randperm(nb, generator=gen).view(len(lens), width)
    for b, n in enumerate(lens):
        for pos in range(n):
            block, row = tables[b, pos // block_size], pos % block_size
            k_cache[:, block, row] = _bf16(n_kv, dim, gen=gen)
            v_cache[:, block, row] = _bf16(n_kv, dim, gen=gen)
    q = _bf16(len(lens), n_kv * group, dim, gen=gen, scale=2.0)
    seq_lens = torch.tensor(lens)
    ours = ops.paged_decode(q, k_cache, v_cache, tables, seq_lens)
    assert torch.isfinite(ours.float()).all()
    ref = paged_decode(
        q.double(), k_cache.double().nan_to_num(0, 0, 0), v_cache.double().nan_to_num(0, 0, 0),
        tables, seq_lens,
    )  # fmt: skip
    torch.testing.assert_close(ours.double(), ref, rtol=2 * BF16_STEP, atol=2e-3)


@pytest.mark.parametrize(("start", "t"), [(0, 1), (0, 40), (23, 9), (0, 200), (300, 64)])
def test_native_prefill_matches_float64_on_both_of_its_routes(
    ops: cpu_ops.CpuOps, start: int, t: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short chunks run as one decode row per token, long ones (past SHORT_PREFILL_PAIRS)
    through gather + SDPA: either way, causal attention over the cached prefix."""
    gen = torch.Generator().manual_seed(start + t)
    n_kv, group, d, bs = 3, 3, 64, 16
    n = start + t
    table = torch.randperm(64, generator=gen)[: -(-n // bs)]
    k_cache, v_cache = (_bf16(n_kv, 64, bs, d, gen=gen) for _ in range(2))
    q = _bf16(t, n_kv * group, d, gen=gen, scale=2.0)
    sdpa_calls: list[int] = []

    def counted(*args: object) -> torch.Tensor:
        sdpa_calls.append(1)
        return paged_prefill(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "paged_prefill", counted)
    prefill = attention.attention_kernels(k_cache, backend="native").prefill
    ours = prefill(q, k_cache, v_cache, table, start)
    ref = paged_prefill(q.double(), k_cache.double(), v_cache.double(), table, start)
    torch.testing.assert_close(ours.double(), ref, rtol=2 * BF16_STEP, atol=2e-3)
    assert bool(sdpa_calls) == (t * n > attention.SHORT_PREFILL_PAIRS)  # the route it took


def _windowed_case(
    lens: list[int], window: int, n_heads: int, n_kv: int, block_size: int, dim: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """Sequences whose keys and values exist only inside their windows: every other slot of
    their blocks holds NaN (keys) and infinity (values), and table entries wholly before a
    window point at block 0, a shared placeholder full of NaN. Returns q, the caches, the
    tables, the lengths and the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    nb = 1 + width * len(lens)
    k_cache = torch.full((n_kv, nb, block_size, dim), float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, float("inf"))
    tables = (1 + torch.randperm(nb - 1, generator=gen)).view(len(lens), width)
    q = _bf16(len(lens), n_heads, dim, gen=gen, scale=2.0)
    refs = []
    for b, n in enumerate(lens):
        first = max(0, n - window)
        keys, values = _bf16(n, n_kv, dim, gen=gen), _bf16(n, n_kv, dim, gen=gen)
        for pos in range(first, n):
            block, row = tables[b, pos // block_size], pos % block_size
            k_cache[:, block, row], v_cache[:, block, row] = keys[pos], values[pos]
        tables[b, : first // block_size] = 0
        refs.append(dense_attention(q[b : b + 1], keys, values, n - 1, window))
    return q, k_cache, v_cache, tables, torch.tensor(lens), torch.cat(refs)


WINDOW_LENS = [1, 15, 16, 17, 40, 83]  # one token, chunk edges, several blocks


# Vector-kernel shapes (block sizes in 16s, dims 64 and 128; GQA 8 query / 2 KV heads) and
# portable-task shapes (block size 5; head dim 256, Gemma 3's).
@pytest.mark.parametrize(
    ("block_size", "dim", "group"), [(16, 64, 4), (32, 128, 2), (5, 64, 3), (16, 256, 2)]
)
@pytest.mark.parametrize("window", [1, 7, 16, 17, 40, 1000])
def test_paged_decode_with_a_window_reads_only_the_window(
    ops: cpu_ops.CpuOps, block_size: int, dim: int, group: int, window: int
) -> None:
    """Windows shorter than, equal to and longer than the sequences, starting mid-block and
    mid-chunk: the result is the float64 windowed attention, and none of the NaN outside
    the windows (in the sequences' blocks or in the placeholder) reaches it."""
    q, k_cache, v_cache, tables, seq_lens, ref = _windowed_case(
        WINDOW_LENS, window, 2 * group, 2, block_size, dim, seed=window + dim + group
    )
    ours = ops.paged_decode(q, k_cache, v_cache, tables, seq_lens, window=window)
    assert torch.isfinite(ours.float()).all()
    torch.testing.assert_close(ours.double(), ref, rtol=2 * BF16_STEP, atol=2e-3)


def test_paged_decode_without_a_window_is_unchanged_by_a_window_past_every_length(
    ops: cpu_ops.CpuOps,
) -> None:
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, tables, seq_lens = _paged_case([1, 17, 33, 100], 6, 2, 16, gen)
    plain = ops.paged_decode(q, k_cache, v_cache, tables, seq_lens)
    assert torch.equal(ops.paged_decode(q, k_cache, v_cache, tables, seq_lens, window=100), plain)
    with pytest.raises(ValueError, match="window must be a positive int or None"):
        ops.paged_decode(q, k_cache, v_cache, tables, seq_lens, window=0)


@pytest.mark.parametrize(
    ("start", "t", "window"),
    [
        (0, 40, 7),  # as decode rows: windows shorter than and equal to the chunk,
        (0, 40, 40),
        (23, 9, 16),  # chunked prefill,
        (5, 30, 64),  # a window past every position,
        (300, 64, 100),  # a long prefix whose early blocks the window skips;
        (0, 200, 180),  # through SDPA: windowed,
        (0, 200, 300),  # and a window past every position
    ],
)
def test_native_kernels_apply_a_window_on_both_prefill_routes_and_in_decode(
    ops: cpu_ops.CpuOps, start: int, t: int, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's native kernels: a prefill chunk as decode rows (each row's own window)
    or, past SHORT_PREFILL_PAIRS, through gather + SDPA; and decode with its key bias
    argument. Head dim 256, 8 query heads on 2 KV heads."""
    gen = torch.Generator().manual_seed(start + t + window)
    n_kv, group, d, bs = 2, 4, 256, 16
    n = start + t
    table = torch.randperm(32, generator=gen)[: -(-n // bs)]
    k_cache, v_cache = (_bf16(n_kv, 32, bs, d, gen=gen) for _ in range(2))
    q = _bf16(t, n_kv * group, d, gen=gen, scale=2.0)
    keys = torch.cat([k_cache[:, b].transpose(0, 1) for b in table.tolist()])[:n]
    values = torch.cat([v_cache[:, b].transpose(0, 1) for b in table.tolist()])[:n]
    sdpa_calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        sdpa_calls.append(1)
        return paged_prefill(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "paged_prefill", counted)
    kernels = attention.attention_kernels(k_cache, backend="native")
    ours = kernels.prefill(q, k_cache, v_cache, table, start, window=window)
    ref = dense_attention(q, keys, values, start, window)
    sdpa = t * min(n, window) > attention.SHORT_PREFILL_PAIRS
    assert bool(sdpa_calls) == sdpa  # the route it took
    # bf16 SDPA rounds its probabilities to bf16 before weighting the values: its error is
    # then about one bf16 step of a value, however small the output.
    atol = 4e-3 if sdpa else 2e-3
    torch.testing.assert_close(ours.double(), ref, rtol=2 * BF16_STEP, atol=atol)

    last = kernels.decode(
        q[-1:], k_cache, v_cache, table[None], torch.tensor([n]), None, window=window
    )
    torch.testing.assert_close(last.double(), ref[-1:], rtol=2 * BF16_STEP, atol=2e-3)


def test_the_vector_paths_are_built_where_the_cpu_has_avx512(ops: cpu_ops.CpuOps) -> None:
    flags = target_flags()
    has = " avx512f" in flags
    assert ops.avx512 == has  # the build follows its target: the host CPU, -march=native
    assert ops.native_bf16 == (has and " avx512_bf16" in flags)


def test_avx512_without_bf16_computes_the_native_sums(ops: cpu_ops.CpuOps, tmp_path: Path) -> None:
    """The AVX-512 paths built without AVX-512 BF16 (Skylake-SP to Ice Lake servers) do each
    bf16 dot product as two float32 FMAs: the sums vdpbf16ps makes, bit for bit (no
    denormals here), for the linear, the gate/up projection and paged decode."""
    if not ops.avx512:
        pytest.skip("this CPU has no AVX-512: cpu_ops builds its portable paths")
    fma = cpu_ops.CpuOps(cpu_ops.build(tmp_path, extra=("-mno-avx512bf16",)))
    assert fma.avx512 and not fma.native_bf16
    # vdpbf16ps's sums: where the host has them, its build without AMX tiles (which sum
    # 16-row blocks in another order) is the reference; elsewhere both builds emulate.
    if ops.native_bf16:
        ops = cpu_ops.CpuOps(cpu_ops.build(tmp_path, extra=("-mno-amx-tile",)))
        assert ops.native_bf16
    gen = torch.Generator().manual_seed(5)
    for m in (1, 7, 300):
        x, w = _bf16(m, 96, gen=gen), _bf16(48 + 32, 96, gen=gen, scale=0.2)
        b = torch.randn(80, generator=gen)
        assert torch.equal(
            fma.linear(x, fma.pack_linear(w), b), ops.linear(x, ops.pack_linear(w), b)
        )
        for act in (False, True):
            got = fma.gate_up(x, fma.pack_gate_up(w[:64]), b[:64], act=act)
            assert torch.equal(got, ops.gate_up(x, ops.pack_gate_up(w[:64]), b[:64], act=act))
    for lens, heads, kv in (([1, 17, 48], 6, 2), ([5, 160], 9, 3)):
        q, k_cache, v_cache, tables, seq_lens = _paged_case(lens, heads, kv, 16, gen)
        ours = fma.paged_decode(q, k_cache, v_cache, tables, seq_lens)
        assert torch.equal(ours, ops.paged_decode(q, k_cache, v_cache, tables, seq_lens))
        ref = paged_decode(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens)
        torch.testing.assert_close(ours.double(), ref, rtol=2 * BF16_STEP, atol=2e-3)
    nan = torch.full((1, 96), float("nan"), dtype=torch.bfloat16)
    assert fma.linear(nan, fma.pack_linear(w), None).isnan().all()


@pytest.mark.parametrize("m", [1, 3, 8, 9, 33, 300])  # row tiles of 8, blocks of 256
@pytest.mark.parametrize(("n", "k"), [(48, 64), (16, 2), (80, 576), (96 + 32, 30)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_float32_accumulation_rounded_once(
    ops: cpu_ops.CpuOps, m: int, n: int, k: int, bias: bool
) -> None:
    """Feature tiles of 48 with 16- and 32-wide tails, any row count, an optional bias:
    the float64 product, rounded to bfloat16 once (a float32 sum in another order may land
    one bfloat16 step away)."""
    gen = torch.Generator().manual_seed(m * n + k)
    x, w = _bf16(m, k, gen=gen), _bf16(n, k, gen=gen, scale=0.2)
    b = torch.randn(n, generator=gen) if bias else None
    ours = ops.linear(x, ops.pack_linear(w), b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    _close_to_one_step(ours, exact.to(torch.bfloat16), exact_share=0.9)
    assert (ours.float() - exact).abs().max() <= BF16_STEP * exact.abs().max()


@pytest.mark.skipif(not X86, reason="x86-64-v3 is an x86 target")
def test_a_build_without_avx512_computes_the_same_functions(portable_dir: Path) -> None:
    """The portable C that CPUs without AVX-512 run (AVX2 here): the linear kernel
    (PackedLinear keeps oneDNN there, but the kernel stays correct) and paged decode."""
    portable = cpu_ops.CpuOps(cpu_ops.build(portable_dir, march=PORTABLE_MARCH))
    assert not portable.avx512 and not portable.linear_supported(96, 64)
    gen = torch.Generator().manual_seed(11)
    x, w = _bf16(9, 64, gen=gen), _bf16(80, 64, gen=gen, scale=0.2)
    b = torch.randn(80, generator=gen)
    exact = (x.double() @ w.double().T + b.double()).to(torch.bfloat16)
    _close_to_one_step(portable.linear(x, portable.pack_linear(w), b), exact, exact_share=0.9)
    packed = portable.pack_gate_up(w[:64])
    plain = portable.gate_up(x, packed, b[:64], act=False)
    _close_to_one_step(plain, exact[:, :64], exact_share=0.9)
    assert torch.equal(portable.gate_up(x, packed, b[:64], act=True), portable.silu_mul(plain))
    q, k_cache, v_cache, tables, seq_lens = _paged_case([1, 17, 48], 6, 2, 16, gen)
    ref = paged_decode(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens)
    ours = portable.paged_decode(q, k_cache, v_cache, tables, seq_lens)
    torch.testing.assert_close(ours.double(), ref, rtol=2 * BF16_STEP, atol=2e-3)
    q, k_cache, v_cache, tables, seq_lens, ref = _windowed_case(WINDOW_LENS, 23, 8, 2, 16, 64, 3)
    ours = portable.paged_decode(q, k_cache, v_cache, tables, seq_lens, window=23)
    torch.testing.assert_close(ours.double(), ref, rtol=2 * BF16_STEP, atol=2e-3)


@pytest.mark.parametrize("m", [1, 9, 300])
@pytest.mark.parametrize(("inter", "k"), [(16, 8), (48, 64), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_is_the_linear_and_its_activation_is_silu_mul_bit_for_bit(
    ops: cpu_ops.CpuOps, m: int, inter: int, k: int, bias: bool
) -> None:
    """The MLP's [gate | up] projection packed in gate/up pairs: its plain output is the
    linear's, and its fused activation is exactly what silu_mul makes of that output."""
    gen = torch.Generator().manual_seed(m + inter + k)
    x, w = _bf16(m, k, gen=gen), _bf16(2 * inter, k, gen=gen, scale=0.3)
    b = torch.randn(2 * inter, generator=gen) if bias else None
    packed = ops.pack_gate_up(w)
    plain = ops.gate_up(x, packed, b, act=False)
    assert torch.equal(plain, ops.linear(x, ops.pack_linear(w), b))
    assert torch.equal(ops.gate_up(x, packed, b, act=True), ops.silu_mul(plain))
    with pytest.raises(ValueError, match="no packed gate/up"):
        ops.pack_gate_up(torch.zeros(48, 8, dtype=torch.bfloat16))  # I = 24


def test_linear_rejects_what_it_cannot_compute(ops: cpu_ops.CpuOps) -> None:
    assert not ops.linear_supported(97, 64) and not ops.linear_supported(96, 63)
    with pytest.raises(ValueError, match="no packed linear"):
        ops.pack_linear(torch.zeros(97, 64, dtype=torch.bfloat16))
    packed = ops.pack_linear(torch.zeros(32, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be \[m, 8\]"):
        ops.linear(torch.zeros(2, 9, dtype=torch.bfloat16), packed, None)
    with pytest.raises(ValueError, match="bias must be float32"):
        ops.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, torch.zeros(32).bfloat16())


def test_paged_decode_reads_strided_queries_and_fills_out(ops: cpu_ops.CpuOps) -> None:
    gen = torch.Generator().manual_seed(7)
    q, k_cache, v_cache, tables, seq_lens = _paged_case([20, 3], 6, 2, 16, gen)
    qkv = torch.cat([q, _bf16(2, 4, 64, gen=gen)], dim=1)  # q as a view into a wider row
    out = torch.empty_like(q)
    result = ops.paged_decode(qkv[:, :6], k_cache, v_cache, tables, seq_lens, out=out)
    assert result is out
    assert torch.equal(out, ops.paged_decode(q, k_cache, v_cache, tables, seq_lens))


def test_wrappers_reject_what_the_kernels_cannot_read(ops: cpu_ops.CpuOps) -> None:
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        ops.add_rms_norm(None, x.float(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="weight has 4"):
        ops.add_rms_norm(None, x, torch.ones(4, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        ops.silu_mul(torch.zeros(8, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="odd width"):
        ops.silu_mul(torch.zeros(2, 7, dtype=torch.bfloat16))
    cache = torch.zeros(2, 4, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="seq_lens"):
        ops.paged_decode(
            torch.zeros(1, 4, 8, dtype=torch.bfloat16), cache, cache,
            torch.zeros(1, 1, dtype=torch.long), torch.tensor([1], dtype=torch.int32),
        )  # fmt: skip
    with pytest.raises(ValueError, match="KV heads"):
        ops.paged_decode(
            torch.zeros(1, 3, 8, dtype=torch.bfloat16), cache, cache,
            torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]),
        )  # fmt: skip


def test_build_is_cached_and_reports_a_missing_compiler(
    portable_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (first,) = portable_dir.iterdir()  # the fixture's build, and no temporary beside it
    assert first.name.startswith("cpu_ops-") and first.suffix == ".so"
    mtime = first.stat().st_mtime_ns
    assert cpu_ops.build(portable_dir, march=PORTABLE_MARCH) == first
    assert first.stat().st_mtime_ns == mtime and list(portable_dir.iterdir()) == [first]

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_ops.build(tmp_path / "other")
    monkeypatch.setenv("HOTPOOL_KERNEL_CACHE", str(tmp_path / "other"))
    cpu_ops.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert cpu_ops.load() is None
        assert "using torch ops" in caplog.text
        monkeypatch.delenv("CC")
        monkeypatch.setenv("HOTPOOL_CPU_KERNELS", "0")
        cpu_ops.load.cache_clear()
        assert cpu_ops.load() is None  # turned off
    finally:
        cpu_ops.load.cache_clear()


def test_softmax_t_is_torch_softmax_of_the_scaled_row_and_masks_exactly(
    ops: cpu_ops.CpuOps,
) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 49152, generator=gen) * 4
    x[0, :100] = float("-inf")  # masked tokens
    x[2, 17] = float("nan")
    x[3, 5] = float("inf")
    x[4] = float("-inf")
    x[4, 9] = 3.0  # one token left
    t = torch.tensor([0.7, 1.0, 1.3, 2.0, 0.5])
    w = ops.softmax_t(x, t[:, None])
    ref = torch.softmax(x.double() / t[:, None].double(), dim=1)
    for r in (0, 1, 4):
        torch.testing.assert_close(w[r].double(), ref[r], rtol=1e-5, atol=1e-12)
    assert (w[0, :100] == 0).all()
    assert w[2].isnan().all() and w[3].isnan().all()  # as torch's softmax
    assert w[4, 9] == 1.0 and w[4].sum() == 1.0


def test_sum_above_adds_the_weights_strictly_above_the_pivot(ops: cpu_ops.CpuOps) -> None:
    gen = torch.Generator().manual_seed(8)
    w = torch.softmax(torch.randn(6, 1000, generator=gen), dim=1)
    pivot = w[:, 10:11].clone()
    pivot[5] = float("nan")  # a NaN row: nothing is above its pivot
    want = torch.where(w > pivot, w.double(), 0.0).sum(dim=1, keepdim=True)
    torch.testing.assert_close(ops.sum_above(w, pivot).double(), want, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="float32"):
        ops.sum_above(w.double(), pivot)
    with pytest.raises(ValueError, match="contiguous"):
        ops.softmax_t(w.t(), pivot)
    with pytest.raises(ValueError, match="6 float32"):
        ops.softmax_t(w, pivot[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_as_argmax_and_flags_rows_without_a_distribution(
    ops: cpu_ops.CpuOps, dtype: torch.dtype
) -> None:
    """The engine's greedy picks (``CpuOps.greedy``): the first index of each chosen row's
    largest value, as torch.argmax; -1 for a row with a NaN or +inf, or all -inf."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 50_000, generator=gen).to(dtype)
    logits[1, 7] = float("nan")
    logits[2, 49_999] = float("inf")
    logits[3] = float("-inf")
    logits[4, 11] = logits[4, 40_000] = 100.0  # a tie: the first wins
    logits[5, :-1] = float("-inf")  # one finite logit, the last
    logits[6, 0] = 50.0
    logits[7, 49_999] = 50.0
    rows = torch.tensor([8, 0, 1, 2, 3, 4, 5, 6, 7, 0])
    got = ops.greedy(logits, rows)
    want = logits.float().argmax(dim=1)[rows]
    for i, r in enumerate(rows.tolist()):
        assert got[i] == (-1 if r in (1, 2, 3) else want[i]), r
    assert got.tolist()[5:9] == [11, 49_999, 0, 49_999]  # rows 4-7
    wide = torch.randn(4, 70, generator=gen).to(dtype)
    assert torch.equal(ops.greedy(wide[:, 5:65], torch.arange(4)), wide[:, 5:65].float().argmax(1))
    for bad, match in (
        (logits.half(), "float32 or bfloat16"),
        (logits[:, ::2], "contiguous rows"),
    ):
        with pytest.raises(ValueError, match=match):
            ops.greedy(bad, rows)
    with pytest.raises(ValueError, match="index"):
        ops.greedy(logits, torch.tensor([9]))
    with pytest.raises(ValueError, match="int64"):
        ops.greedy(logits, torch.tensor([0], dtype=torch.int32))
