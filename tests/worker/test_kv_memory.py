"""The KV cache's host memory: lazily zeroed huge-page mappings, populated in the background
without disturbing what the engine writes meanwhile."""

from __future__ import annotations

import gc
import platform
from pathlib import Path

import pytest
import torch

from hotpool.worker.models import kv_memory
from hotpool.worker.models.attention import PagedKVCache

MIB = 1 << 20


def _resident_bytes(address: int) -> int:
    """Rss of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def _populate_supported() -> bool:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return platform.system() == "Linux" and (major, minor) >= (5, 14)


def test_zeros_are_zero_and_start_on_a_huge_page_boundary() -> None:
    t = kv_memory.zeros((3, 5, 16, 64), torch.bfloat16)
    assert t.shape == (3, 5, 16, 64) and t.dtype == torch.bfloat16
    assert t.data_ptr() % kv_memory.HUGE_PAGE == 0
    assert not t.any()


@pytest.mark.skipif(not _populate_supported(), reason="MADV_POPULATE_WRITE needs Linux 5.14+")
def test_population_faults_every_page_in_and_keeps_what_was_written_meanwhile() -> None:
    t = kv_memory.zeros((64 * MIB // 2,), torch.bfloat16)
    assert _resident_bytes(t.data_ptr()) < 8 * MIB  # lazily zeroed: nothing touched yet
    done = kv_memory.populate_in_background(t)
    # Written while the thread may be populating: population must not zero it again.
    marks = torch.arange(0, t.numel(), 4099)
    t[marks] = 3.0
    assert done.wait(timeout=60)
    assert _resident_bytes(t.data_ptr()) >= 64 * MIB
    assert (t[marks] == 3.0).all()
    t[marks] = 0.0
    assert not t.any()


def test_a_dropped_tensor_ends_the_thread() -> None:
    t = kv_memory.zeros((1 << 30,), torch.uint8)
    done = kv_memory.populate_in_background(t)
    del t
    gc.collect()
    assert done.wait(timeout=60)


def test_the_paged_cache_reports_when_its_pages_are_in() -> None:
    cache = PagedKVCache(2, 64, 16, 2, 32, torch.bfloat16, torch.device("cpu"))
    assert cache.populated.wait(timeout=60)
    assert cache.storage.data_ptr() % kv_memory.HUGE_PAGE == 0
    assert not cache.storage.any()


@pytest.mark.skipif(not _populate_supported(), reason="MADV_POPULATE_WRITE needs Linux 5.14+")
def test_population_waits_while_a_forward_pass_runs() -> None:
    """A core zeroing pages held up every step of the forward pass beside it: the thread
    populates nothing while a pass runs, and goes on once passes stop."""
    t = kv_memory.zeros((16 * MIB,), torch.uint8)
    with kv_memory.foreground():
        done = kv_memory.populate_in_background(t)
        assert not done.wait(timeout=0.5)
        assert _resident_bytes(t.data_ptr()) < 4 * MIB  # not a page of it
    assert done.wait(timeout=60)
    assert _resident_bytes(t.data_ptr()) >= 16 * MIB
