"""Fused bfloat16 CPU kernels (``cpu_ops.c``), built on first use and called through ctypes.

The C source is compiled once per machine with the system compiler (``$CC``, else ``cc``)
for the host CPU (``-march=native``) into a cache folder keyed by the source, the flags and
the CPU, then loaded with ctypes: a build takes a few seconds and later loads are instant.
Plain C rather than a torch extension: no torch headers, so the build is fast and needs
nothing but a C compiler. Where there is none, or the build fails, :func:`load` returns
None (and logs why once) and callers keep the torch implementations, which compute the
same functions.

Each wrapper checks what the C code relies on (dtype, device, contiguity, shapes) and raises
ValueError naming the argument; the checks are attribute reads, cheap next to a kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from hotpool.kernels.paged_attention import check_window

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.c")
# -fno-trapping-math: nothing here reads floating-point exception flags, and without it gcc
# keeps the clamps and selects of exp_f32 and f2bf as branches on AVX2, where they then do
# not vectorise (silu_mul: 3 us a SmolLM2 layer with it, 20 without, on a Zen 3). It
# changes no value: it is not -ffast-math.
FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
MAX_HEAD_DIM = 1024  # hp_rope's stack buffers
INCLUDED = ("amx_tiles.h", "cpu_program.c")  # the files cpu_ops.c includes

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES: dict[str, tuple[type, ...]] = {
    "hp_add_rms_norm": (_P, _P, _P, _P, _I, _I, _F),
    "hp_silu_mul": (_P, _P, _I, _I),
    "hp_embed": (_P, _I, _I, _P, _I, _P),
    "hp_add": (_P, _P, _I),
    "hp_widen": (_P, _P, _I),
    "hp_run_program": (_P, _I, _P),
    "hp_rope": (_P, _I, _I, _I, _I, _P, _P, _P),
    "hp_write_kv": (_P, _I, _P, _I, _I, _I, _I, _P, _P, _P, _I),
    "hp_paged_decode": (_P, _I, _P, _P, _I, _I, _P, _I, _P, _I, _P, _I, _I, _I, _I, _F),
    "hp_pack_linear": (_P, _I, _I, _P),
    "hp_linear": (_P, _I, _I, _P, _I, _P, _P),
    "hp_pack_gate_up": (_P, _I, _I, _P),
    "hp_gate_up": (_P, _I, _I, _P, _I, _P, ctypes.c_int, _P),
    "hp_softmax_t": (_P, _I, _I, _P, _P),
    "hp_sum_above": (_P, _I, _I, _P, _P),
    "hp_greedy": (_P, ctypes.c_int, _I, _P, _I, _I, _P),
    "hp_sample": (_P, _I, _I, _P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _P, _P),
}


# Held while a library is built or loaded (hotpool.kernels.prebuild builds them in a thread).
BUILD_LOCK = threading.RLock()


def cache_dir() -> Path:
    """Where built libraries live: ``$HOTPOOL_KERNEL_CACHE``, else the user's cache folder."""
    if env := os.environ.get("HOTPOOL_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hotpool" / "kernels"


def target_march() -> str:
    """The ``-march`` the process's kernels build for: ``$HOTPOOL_CPU_MARCH``, else ``native``.
    Another target (``x86-64-v3``: AVX2 and FMA, no AVX-512) runs another CPU class's paths
    on this machine; docs/testing.md runs the suite so, as an AVX2-only CPU would."""
    return os.environ.get("HOTPOOL_CPU_MARCH") or "native"


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build(
    directory: Path | None = None, march: str = "native", extra: tuple[str, ...] = ()
) -> Path:
    """Compile ``cpu_ops.c`` unless a build for this source, compiler and CPU exists; returns
    the library's path. Raises RuntimeError with the compiler's message when it fails.
    Another ``march``, or ``extra`` flags (``-mno-avx512bf16``), build the paths that other
    CPUs take: tests compare them."""
    compiler = os.environ.get("CC", "cc")
    flags = (f"-march={march}", *extra, *FLAGS)
    included = [SOURCE.with_name(name).read_bytes() for name in INCLUDED]
    parts = [SOURCE.read_bytes(), *included, " ".join(flags), compiler, _cpu_fingerprint()]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    key = digest.hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"cpu_ops-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent workers never load a half-written file.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    except FileNotFoundError as exc:
        raise RuntimeError(f"no C compiler ({compiler}): {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CpuOps:
    """The loaded library, one method per kernel. Tensors are bfloat16 on the CPU."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = None  # hp_sample's is set below
        lib.hp_sample.restype = ctypes.c_int64
        lib.hp_greedy.restype = ctypes.c_int64
        lib.hp_embed.restype = ctypes.c_int64
        lib.hp_run_program.restype = ctypes.c_int64
        lib.hp_op_size.argtypes = ()
        lib.hp_op_size.restype = ctypes.c_int64
        lib.hp_linear.restype = ctypes.c_int64
        lib.hp_gate_up.restype = ctypes.c_int64
        for probe in (lib.hp_avx512, lib.hp_native_bf16):
            probe.argtypes = ()
            probe.restype = ctypes.c_int
        self._lib = lib
        # Whether the AVX-512 paths are built (where -march=native has AVX-512F): paged
        # decode's for block sizes in 16s, head dims 64 and 128 and groups up to 8, and the
        # linear kernels. Their bf16 dot products are vdpbf16ps with AVX-512 BF16
        # (native_bf16), else float32 FMAs computing the same sums.
        self.avx512 = bool(lib.hp_avx512())
        self.native_bf16 = bool(lib.hp_native_bf16())

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += x`` in place (x may be None), returns ``rms_norm(residual) * weight``."""
        _bf16(residual, "residual", 2)
        rows, hidden = residual.shape
        if x is not None:
            _bf16(x, "x", 2)
            _same(x, residual, "x", "residual")
        _bf16(weight, "weight", 1)
        if weight.shape[0] != hidden:
            raise ValueError(f"weight has {weight.shape[0]} elements, rows have {hidden}")
        out = torch.empty_like(residual)
        self._lib.hp_add_rms_norm(
            None if x is None else x.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[T, 2 I]`` -> ``[T, I]``."""
        _bf16(gate_up, "gate_up", 2)
        rows, width = gate_up.shape
        if width % 2:
            raise ValueError(f"gate_up has an odd width {width}")
        out = gate_up.new_empty(rows, width // 2)
        self._lib.hp_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``table[ids]``: rows of the bfloat16 embedding ``table`` ``[V, H]`` for the int64
        ``ids`` ``[T]``; IndexError (as torch's) for an id outside ``[0, V)``."""
        _bf16(table, "table", 2)
        rows = ids.shape[0] if ids.dim() == 1 else -1
        _index(ids, "ids", rows)
        vocab, width = table.shape
        out = table.new_empty(rows, width)
        bad = self._lib.hp_embed(
            table.data_ptr(), vocab, width, ids.data_ptr(), rows, out.data_ptr()
        )
        if bad:
            raise IndexError(f"{bad} token id(s) outside the vocabulary [0, {vocab})")
        return out

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``x += y`` in place, rounded as torch's bfloat16 ``add_`` (both contiguous)."""
        _bf16(x, "x", x.dim())
        _bf16(y, "y", x.dim())
        _same(x, y, "x", "y")
        self._lib.hp_add(x.data_ptr(), y.data_ptr(), x.numel())

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        """``x.float()`` for a contiguous bfloat16 ``x`` (exact)."""
        _bf16(x, "x", x.dim())
        out = torch.empty(x.shape, dtype=torch.float32)
        self._lib.hp_widen(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    def rope_(
        self,
        x: torch.Tensor,
        heads: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """RoPE in place on heads ``[0, heads)`` of ``x`` ``[T, H, D]`` (rows may be strided,
        heads contiguous), with :class:`RotaryEmbedding`'s bf16 ``cos`` and signed ``sin``
        tables ``[max_positions, D]``."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 3:
            raise ValueError(f"x must be a [T, H, D] bfloat16 CPU tensor, got {x.dtype} {x.shape}")
        rows, n_heads, dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != dim:
            raise ValueError(f"x heads must be contiguous, got strides {x.stride()}")
        if not 0 < heads <= n_heads or dim % 2 or dim > MAX_HEAD_DIM:
            raise ValueError(f"bad rope shape: heads={heads} of {n_heads}, head_dim={dim}")
        for name, table in (("cos", cos), ("sin", sin)):
            _bf16(table, name, 2)
            if table.shape[1] != dim:
                raise ValueError(f"{name} table is {tuple(table.shape)}, head_dim is {dim}")
        _index(positions, "positions", rows)
        self._lib.hp_rope(
            x.data_ptr(),
            rows,
            x.stride(0),
            heads,
            dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
        )

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``k``/``v`` ``[T, Hkv, D]`` (rows may be strided) at their cache slots."""
        _cache_pair(k_cache, v_cache)
        n_kv, num_blocks, block_size, dim = k_cache.shape
        for name, t in (("k", k), ("v", v)):
            if t.dtype != torch.bfloat16 or t.dim() != 3 or t.shape[1:] != (n_kv, dim):
                raise ValueError(f"{name} must be [T, {n_kv}, {dim}] bfloat16, got {t.shape}")
            if t.stride(2) != 1 or t.stride(1) != dim:
                raise ValueError(f"{name} heads must be contiguous, got strides {t.stride()}")
        _index(slot_mapping, "slot_mapping", k.shape[0])
        self._lib.hp_write_kv(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k.shape[0],
            n_kv,
            dim,
            slot_mapping.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            num_blocks * block_size,
        )

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """``paged_attention.paged_decode``'s function: ``q`` ``[B, Hq, D]`` (rows may be
        strided) over ``seq_lens[b] >= 1`` cached tokens, or their last ``window``; writes
        ``out`` (contiguous) when given. Block tables and lengths are trusted (the engine
        builds them); table entries wholly before a window are never read."""
        check_window(window)
        _cache_pair(k_cache, v_cache)
        n_kv, num_blocks, block_size, dim = k_cache.shape
        if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[2] != dim:
            raise ValueError(f"q must be [B, Hq, {dim}] bfloat16, got {q.dtype} {q.shape}")
        b, n_heads, _ = q.shape
        if n_heads % n_kv or q.stride(2) != 1 or q.stride(1) != dim:
            raise ValueError(f"q {tuple(q.shape)} strides {q.stride()} for {n_kv} KV heads")
        if block_tables.dtype != torch.int64 or block_tables.dim() != 2:
            raise ValueError(f"block_tables must be [B, W] int64, got {block_tables.dtype}")
        if block_tables.shape[0] != b or not block_tables.is_contiguous():
            raise ValueError(f"block_tables {tuple(block_tables.shape)} for {b} sequences")
        _index(seq_lens, "seq_lens", b)
        if out is None:
            out = q.new_empty(q.shape)
        elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
        self._lib.hp_paged_decode(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            num_blocks,
            block_size,
            block_tables.data_ptr(),
            block_tables.shape[1],
            seq_lens.data_ptr(),
            window or 0,  # the C kernel's "no window"
            out.data_ptr(),
            b,
            n_heads,
            n_kv,
            dim,
            dim**-0.5,
        )
        return out

    # The library is process-wide and stateless: models holding it copy and pickle cleanly
    # (a copy shares it; unpickling loads this process's build).
    def __deepcopy__(self, memo: dict[int, object]) -> CpuOps:
        return self

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (load, ())

    def linear_supported(self, out_features: int, in_features: int) -> bool:
        """Whether :meth:`linear` serves this shape faster than oneDNN: with AVX-512
        (elsewhere it runs, slowly, in portable C), n in 16s and k even (see cpu_ops.c)."""
        return self.avx512 and out_features % 16 == 0 and in_features % 2 == 0

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[n, k]`` in :meth:`linear`'s tiled layout (a new tensor, same size)."""
        _bf16(weight, "weight", 2)
        n, k = weight.shape
        if n % 16 or k % 2:
            raise ValueError(f"no packed linear for a [{n}, {k}] weight (n in 16s, k even)")
        out = torch.empty_like(weight)
        self._lib.hp_pack_linear(weight.data_ptr(), n, k, out.data_ptr())
        return out

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [m, k] @ weight.T (+ bias)`` in bfloat16 with float32 accumulation, for a
        weight packed by :meth:`pack_linear`; ``bias`` float32 ``[n]`` or None."""
        x, n, k = _linear_inputs(x, packed, bias)
        y = x.new_empty(x.shape[0], n)
        code = self._lib.hp_linear(
            x.data_ptr(), x.shape[0], k, packed.data_ptr(), n,
            None if bias is None else bias.data_ptr(), y.data_ptr(),
        )  # fmt: skip
        _check_memory(code, "hp_linear")
        return y

    def pack_gate_up(self, weight: torch.Tensor) -> torch.Tensor:
        """The MLP's ``[gate | up]`` weight ``[2 I, k]`` in :meth:`gate_up`'s layout
        (16 gate and 16 up features per tile; I in 16s, k even)."""
        _bf16(weight, "weight", 2)
        n, k = weight.shape
        if n % 32 or k % 2:
            raise ValueError(f"no packed gate/up for a [{n}, {k}] weight (2 I in 32s, k even)")
        out = torch.empty_like(weight)
        self._lib.hp_pack_gate_up(weight.data_ptr(), n // 2, k, out.data_ptr())
        return out

    def gate_up(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, act: bool
    ) -> torch.Tensor:
        """``x @ [gate | up].T (+ bias)`` for a weight packed by :meth:`pack_gate_up`: with
        ``act``, ``silu(gate) * up`` ``[m, I]`` (what ``silu_mul`` makes of the plain
        output), else the plain ``[m, 2 I]``."""
        x, n, k = _linear_inputs(x, packed, bias)
        y = x.new_empty(x.shape[0], n // 2 if act else n)
        code = self._lib.hp_gate_up(
            x.data_ptr(), x.shape[0], k, packed.data_ptr(), n // 2,
            None if bias is None else bias.data_ptr(), int(act), y.data_ptr(),
        )  # fmt: skip
        _check_memory(code, "hp_gate_up")
        return y

    def softmax_t(self, x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """``softmax(x / temperature)`` over rows of float32 ``x`` ``[R, V]`` (contiguous),
        one temperature per row (``[R]`` or ``[R, 1]``). Arguments of exp below -87.3
        count as 0: -inf logits weigh exactly 0."""
        _f32_rows(x, "x")
        t = _f32_column(temperature, x.shape[0], "temperature")
        out = torch.empty_like(x)
        self._lib.hp_softmax_t(x.data_ptr(), x.shape[0], x.shape[1], t.data_ptr(), out.data_ptr())
        return out

    def sum_above(self, w: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
        """``[R, 1]``: each row's sum of the float32 weights ``w`` ``[R, V]`` (contiguous)
        strictly greater than its ``pivot``."""
        _f32_rows(w, "w")
        p = _f32_column(pivot, w.shape[0], "pivot")
        out = w.new_empty(w.shape[0], 1)
        self._lib.hp_sum_above(w.data_ptr(), w.shape[0], w.shape[1], p.data_ptr(), out.data_ptr())
        return out

    def greedy(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row ``rows`` (int64 indices) of ``logits`` ``[R, V]``
        (float32 or bfloat16, rows contiguous): the first index of the row's largest
        value, as ``torch.argmax`` picks, or -1 for a row with a NaN or +inf, or with every
        logit -inf. int64 ``[len(rows)]``."""
        if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"logits must be [R, V] float32 or bfloat16, got {logits.dtype}")
        if logits.shape[1] == 0 or logits.stride(1) != 1:
            raise ValueError(f"logits {tuple(logits.shape)} need V > 0 and contiguous rows")
        if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous():
            raise ValueError("rows must be a contiguous int64 vector")
        if len(rows) and not (int(rows.min()) >= 0 and int(rows.max()) < logits.shape[0]):
            raise ValueError(f"rows must index the {logits.shape[0]} rows of logits")
        out = torch.empty(len(rows), dtype=torch.int64)
        self._lib.hp_greedy(
            logits.data_ptr(),
            int(logits.dtype == torch.bfloat16),
            logits.stride(0),
            rows.data_ptr(),
            len(rows),
            logits.shape[1],
            out.data_ptr(),
        )
        return out

    def sample(
        self,
        x: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        uniforms: torch.Tensor,
        penalties: Penalties | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One token per row of float32 logits ``x`` ``[R, V]`` (contiguous), with each
        row's float32 ``temperature`` (below 1e-5: greedy), int64 ``top_k`` (0: off),
        ``top_p``, ``min_p``, ``uniforms`` ``[R, N]`` in [0, 1) (the draw's, then one per
        top_p rejection round), ``penalties`` (applied to a copy of each penalized row;
        ``x`` is not changed) and ``mask``, the grammar's int32 token bitmask ``[R, (V +
        31) // 32]`` (``sampling_bitmask``; words contiguous, rows may be strided), applied
        after the penalties. Returns the tokens ``[R]`` int64 (-1 for a masked row whose
        allowed logits are all -inf), a status ``[R]`` int32 (0 sampled; 1 top_p rejected
        every draw, 2 no buffer: the caller samples those rows) and how many rows have a
        nonzero status."""
        _f32_rows(x, "x")
        rows = x.shape[0]
        t = _f32_column(temperature, rows, "temperature")
        p, m = _f32_column(top_p, rows, "top_p"), _f32_column(min_p, rows, "min_p")
        if top_k.dtype != torch.int64 or top_k.numel() != rows:
            raise ValueError(f"top_k must hold {rows} int64 values, got {top_k.dtype}")
        k = top_k.reshape(rows).contiguous()
        _f32_rows(uniforms, "uniforms")
        if uniforms.shape[0] != rows or uniforms.shape[1] < 1:
            raise ValueError(f"uniforms must be [{rows}, N >= 1], got {tuple(uniforms.shape)}")
        pointers: tuple[int | None, ...] = (None,) * 5  # no penalties
        if penalties is not None:
            penalties.check(rows, x.shape[1])
            pointers = tuple(
                getattr(penalties, name).data_ptr()
                for name in ("ids", "offsets", "repetition", "presence", "frequency")
            )
        if mask is not None:
            _bitmask(mask, rows, x.shape[1])
        tokens = torch.empty(rows, dtype=torch.int64)
        status = torch.empty(rows, dtype=torch.int32)
        left = self._lib.hp_sample(
            x.data_ptr(), rows, x.shape[1], t.data_ptr(), k.data_ptr(), p.data_ptr(),
            m.data_ptr(), uniforms.data_ptr(), uniforms.shape[1], *pointers,
            None if mask is None else mask.data_ptr(), 0 if mask is None else mask.stride(0),
            tokens.data_ptr(), status.data_ptr(),
        )  # fmt: skip
        return tokens, status, int(left)


@dataclass(frozen=True)
class Penalties:
    """What ``CpuOps.sample`` penalizes, per row r: ``ids[offsets[r, 0]:offsets[r, 1]]`` are
    the prompt's tokens (repetition only), ``ids[offsets[r, 1]:offsets[r, 2]]`` the
    output's; ``repetition``, ``presence`` and ``frequency`` float32 ``[R]``."""

    ids: torch.Tensor  # int64, flat, each in [0, V)
    offsets: torch.Tensor  # int64 [R, 3]
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor

    def check(self, rows: int, v: int) -> None:
        for name in ("repetition", "presence", "frequency"):
            t = getattr(self, name)
            if t.dtype != torch.float32 or t.shape != (rows,) or not t.is_contiguous():
                raise ValueError(f"penalties.{name} must be [{rows}] float32, got {t.shape}")
        off = self.offsets
        if off.dtype != torch.int64 or off.shape != (rows, 3) or not off.is_contiguous():
            raise ValueError(f"penalties.offsets must be [{rows}, 3] int64, got {off.shape}")
        ids = self.ids
        if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous():
            raise ValueError("penalties.ids must be a flat int64 tensor")
        # numpy: a few calls per batch, each cheaper than a torch op's dispatch
        o, n = off.numpy(), ids.numel()
        if rows and (bool((o[:, 1:] < o[:, :-1]).any()) or o.min() < 0 or o.max() > n):
            raise ValueError("penalties.offsets must be ascending ranges inside penalties.ids")
        if n and (ids.numpy().min() < 0 or ids.numpy().max() >= v):
            raise ValueError(f"penalty token ids must be in [0, {v})")


def _f32_rows(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2:
        raise ValueError(f"{name} must be a [R, V] float32 CPU tensor, got {t.dtype} {t.shape}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _bitmask(t: torch.Tensor, rows: int, v: int) -> None:
    words = (v + 31) // 32
    if t.dtype != torch.int32 or t.device.type != "cpu" or t.shape != (rows, words):
        raise ValueError(
            f"mask must be a [{rows}, {words}] int32 CPU tensor, got {t.dtype} {tuple(t.shape)}"
        )
    if words > 1 and t.stride(1) != 1:
        raise ValueError(f"mask words must be contiguous, got strides {t.stride()}")


def _f32_column(t: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """One float32 value per row, contiguous (a ``[R, 1]`` column or ``[R]``)."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.numel() != rows:
        raise ValueError(f"{name} must hold {rows} float32 CPU values, got {t.dtype} {t.shape}")
    return t.reshape(rows).contiguous()


def _check_memory(code: int, kernel: str) -> None:
    """A kernel's -2: its buffers could not be allocated (the same code as quant_ops')."""
    if code == -2:
        raise MemoryError(f"{kernel}: out of memory for the kernel's buffers")


def _linear_inputs(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, int, int]:
    """Checks a packed linear's input and bias; returns x contiguous, n and k."""
    n, k = packed.shape
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [m, {k}] bfloat16, got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)):
        raise ValueError(f"bias must be float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
    return x.contiguous(), n, k


def _bf16(t: torch.Tensor, name: str, dims: int) -> None:
    if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D bfloat16 CPU tensor, got {t.dtype} {t.shape}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _same(a: torch.Tensor, b: torch.Tensor, an: str, bn: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{an} {tuple(a.shape)} and {bn} {tuple(b.shape)} differ")


def _index(t: torch.Tensor, name: str, n: int) -> None:
    if t.dtype != torch.int64 or t.device.type != "cpu" or t.shape != (n,):
        raise ValueError(f"{name} must be [{n}] int64 on the CPU, got {t.dtype} {t.shape}")
    if n > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def _cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _bf16(c, name, 4)
    _same(k_cache, v_cache, "k_cache", "v_cache")


@cache
def load() -> CpuOps | None:
    """The kernels for this process, or None where they cannot run (logged once).

    ``HOTPOOL_CPU_KERNELS=0`` turns them off (the torch implementations run instead).
    """
    if os.environ.get("HOTPOOL_CPU_KERNELS", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return None
    try:
        with BUILD_LOCK:  # the warm worker's prebuild and a load may ask at once: one build
            return CpuOps(build(march=target_march()))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels unavailable, using torch ops: %s", exc)
        return None
