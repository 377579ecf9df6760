"""The quantized linear C kernels (``quant_ops.c``), built on first use and called through
ctypes, as :mod:`hotpool.kernels.cpu_ops` builds ``cpu_ops.c``: compiled once per machine
for the host CPU (``-march=native``) into the same cache folder, keyed by the source, the
flags, the compiler and the CPU. Where there is no compiler or the build fails,
:func:`load` returns None (logged once) and callers use the torch fallback.
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
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from hotpool.kernels.cpu_ops import _cpu_fingerprint, cache_dir, target_march
from hotpool.kernels.quant_weight import (
    INTERLEAVED_KINDS,
    GgufKind,
    GgufWeight,
    Int8Weight,
    InterleavedWeight,
    QuantizedWeight,
)

log = logging.getLogger(__name__)
# Held while the library is built or loaded (see cpu_ops.BUILD_LOCK).
BUILD_LOCK = threading.RLock()

SOURCE = Path(__file__).with_name("quant_ops.c")
# The files quant_ops.c includes (its AVX-512 parts): a change to any rebuilds the library.
INCLUDED = (
    "quant_avx2.c",
    "quant_interleaved_avx2.c",
    "quant_avx512.c",
    "quant_amx.c",
    "amx_tiles.h",
    "quant_interleaved.c",
    "quant_panels.c",
)
FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
# quant_ops.c's format codes
_CODES = {GgufKind.Q8_0: 1, GgufKind.Q4_0: 2, GgufKind.Q4_1: 3, GgufKind.Q4_K: 4}
_INTERLEAVED_CODES = {GgufKind.Q8_0: 5, GgufKind.Q4_0: 6, GgufKind.Q4_1: 7}
_INT8 = 0

_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int


def build(
    directory: Path | None = None, march: str = "native", extra: tuple[str, ...] = ()
) -> Path:
    """Compile ``quant_ops.c`` unless a build for this source, compiler and CPU exists;
    returns the library's path. ``march="x86-64"`` builds the portable C path, ``extra``
    adds flags (tests build ``-mno-amx-tile`` to run the AVX-512 path without AMX). Raises
    RuntimeError with the compiler's message when it fails."""
    compiler = os.environ.get("CC", "cc")
    flags = (f"-march={march}", *extra, *FLAGS)
    digest = hashlib.sha256()
    sources = [SOURCE.read_bytes(), *(SOURCE.with_name(n).read_bytes() for n in INCLUDED)]
    for part in (*sources, " ".join(flags), compiler, _cpu_fingerprint()):
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    directory = directory or cache_dir()
    target = directory / f"quant_ops-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent workers never load a half-written file.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", tmp],
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


class QuantOps:
    """The loaded library. :meth:`linear` takes inputs that
    :func:`hotpool.kernels.quant_linear.check_linear_inputs` has already checked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.hq_linear.argtypes = (_C, _P, _I, _C, _I, _I, _P, _I, _P, _P, _P, _C)
        lib.hq_linear.restype = _C
        lib.hq_row_bytes.argtypes = (_C, _I)
        lib.hq_row_bytes.restype = _I
        lib.hq_simd.argtypes = ()
        lib.hq_simd.restype = _C
        lib.hq_amx.argtypes = ()
        lib.hq_amx.restype = _C
        self._lib = lib
        self.simd = {3: "avx512_bf16", 2: "avx512", 1: "avx2"}.get(lib.hq_simd(), "portable")
        # Whether more rows than streaming's multiply on AMX tiles; where the weights are
        # split into bf16 hi + lo (the row layout past 4 rows, interleaved past 96), x @ W.T
        # comes to ~2**-15 of |x| |w| rather than to float32 rounding.
        self.amx = bool(lib.hq_amx())

    def supports(self, qw: QuantizedWeight) -> bool:
        """CPU weights in GGUF blocks, or int8 with one scale per output feature; GGUF
        blocks interleaved (:meth:`interleaves`) on AVX-512 and AVX2 builds."""
        if qw.device.type != "cpu":
            return False
        if isinstance(qw, Int8Weight):
            return qw.scale.dim() == 1
        if isinstance(qw, InterleavedWeight):
            return self.simd != "portable"
        return isinstance(qw, GgufWeight)

    def interleaves(self, qw: QuantizedWeight) -> bool:
        """Whether ``qw`` is served faster interleaved here (quant_interleave.py): Q8_0,
        Q4_0 and Q4_1 wherever the SIMD kernels build: one scale conversion serves 16
        features, and every row count's path reads the layout (AVX-512: streaming 8 rows a
        pass, past 8 rows AMX tiles where the CPU has them; AVX2: quant_interleaved_avx2.c)."""
        return (
            self.simd != "portable"
            and isinstance(qw, GgufWeight)
            and qw.kind in INTERLEAVED_KINDS
            and qw.device.type == "cpu"
        )

    def row_bytes(self, qw: GgufWeight) -> int:
        """The C code's size of a row of blocks (tests hold it to :class:`GgufKind`'s)."""
        return int(self._lib.hq_row_bytes(_CODES[qw.kind], qw.shape[1]))

    def linear(
        self, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [m, k] @ W.T (+ bias)`` in ``x``'s dtype (float32 or bfloat16; rows may be
        strided), for a weight :meth:`supports`; ``bias`` float32 ``[n]`` or None."""
        return self.bind(qw, bias)(x)

    def bind(
        self, qw: QuantizedWeight, bias: torch.Tensor | None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`linear` with the weight and bias fixed: what a layer calls every step.
        A decode step makes ~120 such calls, so the per-call Python is kept to a ctypes
        call and the output's allocation. The weight's and bias's tensors must stay where
        they are while the callable is used (QuantizedLinear rebinds when they move)."""
        n, k = qw.shape
        if isinstance(qw, Int8Weight):
            code, data, scale = _INT8, qw.q.data_ptr(), qw.scale.data_ptr()
        elif isinstance(qw, GgufWeight):
            code, data, scale = _CODES[qw.kind], qw.data.data_ptr(), None
        elif isinstance(qw, InterleavedWeight):
            code, data, scale = _INTERLEAVED_CODES[qw.kind], qw.data.data_ptr(), None
        else:
            raise ValueError(f"the C kernels take int8 and GGUF weights, not {type(qw).__name__}")
        b = None if bias is None else bias.data_ptr()
        name = type(qw).__name__

        def call(x: torch.Tensor) -> torch.Tensor:
            m = x.shape[0]
            y = torch.empty((m, n), dtype=x.dtype)
            bf16 = 1 if x.dtype is torch.bfloat16 else 0
            # The library is looked up per call: a kernel program's recorder swaps it.
            rc = self._lib.hq_linear(
                code, x.data_ptr(), x.stride(0), bf16, m, k, data, n, scale, b, y.data_ptr(), bf16
            )
            if rc == -2:
                raise MemoryError("quant_ops: out of memory for the kernel's buffers")
            if rc != 0:
                raise ValueError(f"quant_ops rejected a {name} of shape {qw.shape}")
            return y

        return call

    # Process-wide and stateless: modules holding it copy and pickle cleanly.
    def __deepcopy__(self, memo: dict[int, object]) -> QuantOps:
        return self

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (load, ())


@cache
def load() -> QuantOps | None:
    """The kernels for this process, or None where they cannot run (logged once).
    ``HOTPOOL_CPU_KERNELS=0`` turns them off, as it does :mod:`cpu_ops`."""
    if os.environ.get("HOTPOOL_CPU_KERNELS", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return None
    try:
        with BUILD_LOCK:  # the warm worker's prebuild and a load may ask at once: one build
            return QuantOps(build(march=target_march()))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("quantized linear C kernels unavailable, using torch: %s", exc)
        return None
