"""Build the CPU kernels before a request waits on them.

The C libraries (:mod:`cpu_ops`, :mod:`quant_ops`) are compiled once per machine and kept in
the kernel cache, but that once used to be the first cold start: ~9 s of compiler on a 2-core
machine inside a user's first request. ``hotpool models pull`` builds them (a pull is what
comes before a first serve) and every CPU worker starts building them in a thread as soon as
it starts, idle in the warm pool (:mod:`hotpool.worker.idle_prep`); a load that needs them
meanwhile waits for that build (the modules' ``BUILD_LOCK``), never starts a second one.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from hotpool.kernels import cpu_ops, quant_ops


def build_all() -> float:
    """Build (or find in the cache) and load every CPU kernel library, the two side by side;
    the seconds it took. A library that cannot be built is logged by its ``load`` and left
    out: the torch implementations run instead."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="kernel-build") as pool:
        for done in [pool.submit(cpu_ops.load), pool.submit(quant_ops.load)]:
            done.result()
    return time.perf_counter() - start
