"""The CPU features hotpool's C kernels are built for, in ``/proc/cpuinfo``'s words: the
host's own, or those of ``$HOTPOOL_CPU_MARCH`` (``.ci/as_avx2`` runs the suite as an AVX2-only
CPU would), as the compiler defines them for that target."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from hotpool.kernels.cpu_ops import target_march

# The compiler's macro for each feature the kernels choose a path by.
MACROS = {
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512VL__": "avx512vl",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16",
    "__AMX_TILE__": "amx_tile",
}


def target_flags() -> str:
    """A ``flags`` line (or the whole cpuinfo) where ``f" {flag}" in`` it tells a feature."""
    march = target_march()
    if march == "native":
        cpuinfo = Path("/proc/cpuinfo")
        return cpuinfo.read_text() if cpuinfo.exists() else ""
    compiler = os.environ.get("CC", "cc")
    defined = subprocess.run(
        [compiler, f"-march={march}", "-dM", "-E", "-"],
        input="", capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return "flags\t: " + " ".join(f for m, f in MACROS.items() if f"#define {m} " in defined)
