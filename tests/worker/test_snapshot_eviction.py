"""The snapshot cache under a byte budget: least-recently-used eviction that never touches a
pinned snapshot (in this process or another), an order that survives restarts, and cleanup
of temp folders a crashed process left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from snapshot_folders import snapshot_bytes, snapshot_folder
from test_snapshot_cache import cache_entries

from hotpool.settings import load_settings
from hotpool.worker.snapshot import locks
from hotpool.worker.snapshot.cache import LOCKS_DIR, SnapshotCache
from hotpool.worker.snapshot.store import push_snapshot

SIZE = snapshot_bytes()  # one of the snapshots below
BUDGET_FOR_TWO = 2 * SIZE + 100


@pytest.fixture
def uris(tmp_path: Path) -> dict[str, str]:
    """Four small snapshots with different weights, pushed to a file:// store."""
    out = {}
    for name in "abcd":
        uri = f"file://{tmp_path}/objects/{name}"
        push_snapshot(snapshot_folder(tmp_path / "local" / name, name.encode() * 5000), uri)
        out[name] = uri
    return out


def cached(cache: SnapshotCache, uris: dict[str, str]) -> set[str]:
    """Names of the snapshots the cache holds."""
    digests = {cache.manifest(uri).digest: name for name, uri in uris.items()}
    return {digests[e.digest] for e in cache.entries()}


def test_least_recently_used_goes_first(tmp_path: Path, uris: dict[str, str]) -> None:
    cache = SnapshotCache(tmp_path / "cache", max_bytes=BUDGET_FOR_TWO)
    cache.fetch(uris["a"])
    cache.fetch(uris["b"])
    assert cache.fetch(uris["a"]).cache_hit  # a is now used more recently than b

    cache.fetch(uris["c"])

    assert cached(cache, uris) == {"a", "c"}
    assert sum(e.size for e in cache.entries()) <= BUDGET_FOR_TWO
    assert not cache.fetch(uris["b"]).cache_hit  # evicted for real: fetched again


def test_a_pinned_snapshot_is_never_evicted(tmp_path: Path, uris: dict[str, str]) -> None:
    cache = SnapshotCache(tmp_path / "cache", max_bytes=SIZE + 100)  # room for one
    a = cache.fetch(uris["a"], pin=True)

    cache.fetch(uris["b"])  # over budget while a is pinned: b stays until the next fetch
    cache.fetch(uris["c"])
    assert cached(cache, uris) == {"a", "c"}
    assert (a.path / "model.safetensors").read_bytes() == b"a" * 5000

    cache.unpin(a.manifest.digest)
    cache.fetch(uris["d"])
    assert cached(cache, uris) == {"d"}


def test_use_pins_for_the_block(tmp_path: Path, uris: dict[str, str]) -> None:
    cache = SnapshotCache(tmp_path / "cache", max_bytes=SIZE + 100)
    with cache.use(uris["a"]) as snap:
        assert cache.is_pinned(snap.manifest.digest)
        cache.fetch(uris["b"])
        assert (snap.path / "config.json").is_file()
    assert not cache.is_pinned(snap.manifest.digest)
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin(snap.manifest.digest)


def test_a_pin_held_by_another_process_is_respected(tmp_path: Path, uris: dict[str, str]) -> None:
    """Two caches over one folder stand for two worker processes sharing a disk."""
    other = SnapshotCache(tmp_path / "cache")
    held = other.fetch(uris["a"], pin=True)
    cache = SnapshotCache(tmp_path / "cache", max_bytes=SIZE + 100)

    cache.fetch(uris["b"])
    cache.fetch(uris["c"])

    assert cached(cache, uris) == {"a", "c"}
    other.unpin(held.manifest.digest)  # a counts as used just now: c is the older one
    assert cache.evict() == [cache.manifest(uris["c"]).digest]
    assert cached(cache, uris) == {"a"}


def test_the_order_survives_a_restart(tmp_path: Path, uris: dict[str, str]) -> None:
    before = SnapshotCache(tmp_path / "cache")
    for name in "bac":
        before.fetch(uris[name])

    after = SnapshotCache(tmp_path / "cache", max_bytes=BUDGET_FOR_TWO)
    assert after.fetch(uris["c"]).cache_hit
    after.fetch(uris["d"])

    assert cached(after, uris) == {"c", "d"}


def test_a_snapshot_larger_than_the_budget_is_still_fetched(
    tmp_path: Path, uris: dict[str, str]
) -> None:
    cache = SnapshotCache(tmp_path / "cache", max_bytes=SIZE // 2)
    cache.fetch(uris["a"])
    snap = cache.fetch(uris["b"], pin=True)
    assert cached(cache, uris) == {"b"}
    assert (snap.path / "model.safetensors").is_file()


def test_temp_folders_of_dead_fetches_are_removed(tmp_path: Path, uris: dict[str, str]) -> None:
    root = tmp_path / "cache"
    digest = SnapshotCache(root).fetch(uris["a"]).manifest.digest
    dead, live = f".tmp-{'1' * 64}-0badcafe", f".tmp-{'2' * 64}-c0ffee00"
    for name in (dead, live):
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(b"half a download")
    (root / "notes.txt").write_text("not the cache's")
    # A fetch of digest 222... is running in another process: it holds the fetch lock.
    fd = locks.acquire(root / LOCKS_DIR / f"{'2' * 64}.fetch", locks.EXCLUSIVE)
    try:
        cache = SnapshotCache(root)
        assert cache_entries(root) == sorted([digest, live, "notes.txt"])
    finally:
        os.close(fd)
    assert cache.remove_stale_tmp() == [live]
    assert cache_entries(root) == [digest, "notes.txt"]
    assert cache.fetch(uris["a"]).cache_hit


def test_the_budget_setting(tmp_path: Path) -> None:
    assert load_settings({"HOTPOOL_HOME": str(tmp_path)}).snapshot_cache_bytes == 20 << 30
    env = {"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_SNAPSHOT_CACHE_BYTES": "512m"}
    assert load_settings(env).snapshot_cache_bytes == 512 << 20
