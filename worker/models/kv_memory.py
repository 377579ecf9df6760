"""Host memory for the KV cache: zeroed lazily, in transparent huge pages, and faulted in
by a background thread rather than by the requests that first write it.

Why each part (numbers from the 2-core dev VM, SmolLM2-135M, B=32):

- **Lazy zeros.** An anonymous private ``mmap`` is zeroed by the kernel page by page on
  first use, so creating a 1 GiB cache costs under a millisecond; ``torch.zeros`` would
  spend 0.3 s or more writing it, on the critical path of a cold start (the host-cache
  cold start's target is 0.3 s in all). Zeros, not garbage: the torch decode path reads
  padding blocks, masked, and NaN * 0 would still be NaN.
- **Huge pages.** ``MADV_HUGEPAGE`` (hosts default to ``madvise`` mode) gets 2 MiB pages.
  Decode attention reads 4 KiB of keys and values per block from all over the cache; with
  4 KiB pages nearly every block costs a TLB miss. Paged decode over 30 layers, blocks as
  the engine hands them out: 10.3 -> 8.5 ms a step.
- **Populated in the background.** The first write to each page faults (and, on a VM, so
  does the host): left to ``write_kv``, that cost ~100 ms of each 2,048-token prefill step
  and ~2 ms of each decode step until the cache had been used once. ``MADV_POPULATE_WRITE``
  (Linux 5.14+) faults pages in without changing their contents, so a daemon thread can do
  it while the replica already serves; it runs at the lowest priority, holds no GIL (ctypes
  releases it) and stops when the cache is dropped. Populating 1 GiB takes 0.1-2 s of one
  core here. Older kernels keep the lazy faults.
- **Only while the model is idle.** A lower priority did not keep the thread out of the
  way: the forward pass runs on every core, and a core busy zeroing pages held up each step
  (1 GiB populating beside a cold start's warm-up: 1.5 s against 0.33 s, and the first
  requests after it ~0.3 s more to their first token). The forward passes say when they
  run (:func:`foreground`) and the thread populates a few MiB at a time, only once none
  has run for :data:`IDLE_S`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; not in Python's mmap module
_CHUNK = 4 << 20  # bytes a madvise call populates: ~1 ms, what a step may wait behind it
IDLE_S = 0.05  # how long no forward pass must have run before the thread goes on


class _Foreground:
    """Whether a forward pass is running, and when the last one ended (any model of the
    process: a worker runs one, plus a draft model's)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.ended = 0.0

    def idle_for(self) -> float:
        with self.lock:
            return 0.0 if self.running else time.monotonic() - self.ended


_FOREGROUND = _Foreground()


@contextlib.contextmanager
def foreground() -> Iterator[None]:
    """Around a forward pass: the KV caches' population waits until passes stop."""
    with _FOREGROUND.lock:
        _FOREGROUND.running += 1
    try:
        yield
    finally:
        with _FOREGROUND.lock:
            _FOREGROUND.running -= 1
            _FOREGROUND.ended = time.monotonic()


def _wait_for_idle() -> None:
    while (idle := _FOREGROUND.idle_for()) < IDLE_S:
        time.sleep(IDLE_S - idle)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on its own mapping, starting on a 2 MiB boundary, in huge pages
    where the host grants them (it still works, in small pages, where it does not)."""
    nbytes = math.prod(shape) * dtype.itemsize
    # One extra huge page of address space (never touched) to start on a 2 MiB boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP disabled ("never") or not built in
            region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def populate_in_background(t: torch.Tensor) -> threading.Event:
    """Fault in the pages of ``t`` (from :func:`zeros`) from a daemon thread, leaving their
    contents as they are (the tensor may be read and written meanwhile). The event is set
    when the thread is done: every page populated, the tensor dropped, or the kernel unable
    to (then pages fault on first use, as before)."""
    done = threading.Event()
    ref = weakref.ref(t)
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    del t  # the thread must not keep the cache alive

    def run() -> None:
        # Lowest priority (Linux takes a thread id here): on a busy replica the serving
        # threads come first, and pages fault on first use as before.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            madvise = _libc_madvise()
            offset = 0
            while offset < nbytes and madvise is not None:
                _wait_for_idle()
                alive = ref()
                if alive is None:
                    return
                length = min(_CHUNK, nbytes - offset)
                # The tensor is held (``alive``) while its pages are populated.
                if madvise(start + offset, length, _MADV_POPULATE_WRITE) != 0:
                    log.debug("MADV_POPULATE_WRITE failed (errno %d)", ctypes.get_errno())
                    return
                del alive
                offset += length
        finally:
            done.set()

    threading.Thread(target=run, name="hotpool-kv-populate", daemon=True).start()
    return done


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # no libc symbol table (not Linux/glibc)
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn
