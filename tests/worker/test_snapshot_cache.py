from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from snapshot_folders import check_store_contract, snapshot_folder

from hotpool.worker.snapshot import store as store_module
from hotpool.worker.snapshot.cache import LOCKS_DIR, SnapshotCache
from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.manifest import MANIFEST_NAME
from hotpool.worker.snapshot.s3 import S3ObjectStore
from hotpool.worker.snapshot.store import (
    FileObjectStore,
    ObjectStore,
    open_snapshot_uri,
    push_snapshot,
)


class CountingStore(ObjectStore):
    """Wraps a store, counts downloads and uploads, and can slow downloads down."""

    def __init__(self, inner: ObjectStore, delay_s: float = 0.0) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.downloads: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def download(
        self, key: str, dest: Path, chunk_cb: Callable[[bytes], None] | None = None
    ) -> None:
        with self._lock:
            self.downloads.append(key)
        time.sleep(self.delay_s)
        self.inner.download(key, dest, chunk_cb)

    def upload(self, src: Path, key: str) -> None:
        self.calls.append(("upload", key))
        self.inner.upload(src, key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.calls.extend(("delete", key) for key in keys)
        self.inner.delete(keys)

    def delete_prefix(self, prefix: str) -> None:
        self.calls.append(("delete_prefix", prefix))
        self.inner.delete_prefix(prefix)


def cache_entries(root: Path) -> list[str]:
    """What the cache folder holds besides its lock files."""
    return sorted(p.name for p in root.iterdir() if p.name != LOCKS_DIR)


@pytest.fixture
def pushed(tmp_path: Path) -> str:
    """URI of a small snapshot pushed into a file:// store."""
    uri = f"file://{tmp_path}/objects/snapshots/tiny"
    push_snapshot(snapshot_folder(tmp_path / "local"), uri)
    return uri


def test_file_store_round_trip_list_and_delete(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "root")
    check_store_contract(store, tmp_path)
    with pytest.raises(SnapshotError, match="invalid object key"):
        store.get_bytes("../outside")


def test_snapshot_uris(tmp_path: Path) -> None:
    store, prefix = open_snapshot_uri(f"file://{tmp_path}/snap/")
    assert isinstance(store, FileObjectStore) and store.root == tmp_path / "snap"
    assert prefix == ""
    s3, prefix = open_snapshot_uri("s3://bucket/snapshots/x/")
    assert isinstance(s3, S3ObjectStore) and s3.bucket == "bucket"
    assert prefix == "snapshots/x/"
    assert open_snapshot_uri("s3://bucket")[1] == ""
    with pytest.raises(SnapshotError, match="s3://bucket/prefix"):
        open_snapshot_uri("s3:///snapshots/x")
    with pytest.raises(SnapshotError, match="three slashes"):
        open_snapshot_uri("file://relative/path")
    with pytest.raises(SnapshotError, match="unsupported"):
        open_snapshot_uri("http://example.com/x")


def test_push_uploads_the_manifest_last_after_removing_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "objects" / "snap"
    recorder = CountingStore(FileObjectStore(target))
    monkeypatch.setattr(store_module, "open_snapshot_uri", lambda uri: (recorder, ""))

    manifest = push_snapshot(snapshot_folder(tmp_path / "local"), f"file://{target}")

    assert recorder.calls[0] == ("delete_prefix", MANIFEST_NAME)
    assert recorder.calls[-1] == ("upload", MANIFEST_NAME)
    assert sorted(key for _, key in recorder.calls[1:-1]) == [f.path for f in manifest.files]
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json",
        MANIFEST_NAME,
        "model.safetensors",
        "tokenizer.json",
    ]


def test_second_fetch_is_a_cache_hit(tmp_path: Path, pushed: str) -> None:
    cache = SnapshotCache(tmp_path / "cache")

    first = cache.fetch(pushed)
    second = cache.fetch(pushed)

    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert first.path == second.path == tmp_path / "cache" / first.manifest.digest
    assert (first.path / "model.safetensors").read_bytes() == b"w" * 5000
    assert (first.path / MANIFEST_NAME).is_file()
    assert first.fetch_seconds > 0 and second.fetch_seconds > 0
    assert cache_entries(tmp_path / "cache") == [first.manifest.digest]


def test_a_local_store_on_the_same_file_system_is_linked_not_copied(
    tmp_path: Path, pushed: str
) -> None:
    """The worker's cache of a file:// snapshot shares the store's bytes (no second copy on
    disk, no write on a cold start), and removing it leaves the store whole."""
    cache = SnapshotCache(tmp_path / "cache", max_bytes=1 << 20)
    cached = cache.fetch(pushed)
    stored = tmp_path / "objects" / "snapshots" / "tiny" / "model.safetensors"
    assert (cached.path / "model.safetensors").stat().st_ino == stored.stat().st_ino
    assert cache.evict(reserve=1 << 30) == [cached.manifest.digest]
    assert stored.read_bytes() == b"w" * 5000


def test_a_store_that_cannot_be_linked_is_copied(
    tmp_path: Path, pushed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cross_device(src: object, dst: object) -> None:  # another file system, as os.link
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(store_module.os, "link", cross_device)
    cached = SnapshotCache(tmp_path / "cache").fetch(pushed)
    stored = tmp_path / "objects" / "snapshots" / "tiny" / "model.safetensors"
    assert (cached.path / "model.safetensors").stat().st_ino != stored.stat().st_ino
    assert (cached.path / "model.safetensors").read_bytes() == b"w" * 5000


def test_a_new_cache_instance_reuses_installed_snapshots(tmp_path: Path, pushed: str) -> None:
    SnapshotCache(tmp_path / "cache").fetch(pushed)
    assert SnapshotCache(tmp_path / "cache").fetch(pushed).cache_hit


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: p.write_bytes(b"x" + p.read_bytes()[1:]), "failed verification: sha256"),
        (lambda p: p.write_bytes(p.read_bytes()[:-10]), "is 4990 bytes, manifest says 5000"),
        (lambda p: p.write_bytes(p.read_bytes() + b"!"), "larger than the 5000 bytes"),
        (lambda p: p.unlink(), "missing from the store"),
    ],
    ids=["flipped-byte", "truncated", "too-long", "missing"],
)
def test_corrupted_store_file_fails_and_leaves_no_valid_looking_folder(
    tmp_path: Path, pushed: str, corrupt: Callable[[Path], object], message: str
) -> None:
    corrupt(tmp_path / "objects" / "snapshots" / "tiny" / "model.safetensors")
    cache = SnapshotCache(tmp_path / "cache")

    with pytest.raises(SnapshotError, match=message) as info:
        cache.fetch(pushed)

    assert "model.safetensors" in str(info.value)
    assert cache_entries(tmp_path / "cache") == []  # no digest folder, no temp folder


def test_fetch_without_manifest_names_the_uri(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/nothing-here"
    with pytest.raises(SnapshotError, match="no snapshot at"):
        SnapshotCache(tmp_path / "cache").fetch(uri)


def test_concurrent_fetches_download_each_file_once(tmp_path: Path, pushed: str) -> None:
    counting = CountingStore(open_snapshot_uri(pushed)[0], delay_s=0.05)
    cache = SnapshotCache(tmp_path / "cache", open_store=lambda uri: (counting, ""))
    results = []

    def fetch() -> None:
        results.append(cache.fetch(pushed))

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(counting.downloads) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(r.cache_hit for r in results) == [False] + [True] * 7
    assert len({r.path for r in results}) == 1


def test_racing_processes_download_once_and_install_one_copy(tmp_path: Path, pushed: str) -> None:
    """Two caches over one folder (as two worker processes sharing a disk would be) share no
    thread lock; the digest's lock file makes the second wait and then hit."""
    inner = open_snapshot_uri(pushed)[0]
    stores = [CountingStore(inner, delay_s=0.05), CountingStore(inner, delay_s=0.05)]
    caches = [
        SnapshotCache(tmp_path / "cache", open_store=lambda uri, s=s: (s, "")) for s in stores
    ]
    results = []
    threads = [threading.Thread(target=lambda c=c: results.append(c.fetch(pushed))) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(results) == 2
    assert results[0].path == results[1].path
    assert sorted(r.cache_hit for r in results) == [False, True]
    assert len(stores[0].downloads) + len(stores[1].downloads) == 3  # each file once in all
    assert cache_entries(tmp_path / "cache") == [results[0].manifest.digest]
    assert (results[0].path / "model.safetensors").read_bytes() == b"w" * 5000


def test_manifest_reads_the_store_without_downloading(tmp_path: Path, pushed: str) -> None:
    cache = SnapshotCache(tmp_path / "cache")
    manifest = cache.manifest(pushed)
    assert manifest == cache.fetch(pushed).manifest
    assert [p.name for p in (tmp_path / "cache").iterdir()].count(manifest.digest) == 1
    with pytest.raises(SnapshotError, match="no snapshot at"):
        SnapshotCache(tmp_path / "cache").manifest(f"file://{tmp_path}/nothing-here")


def test_file_store_delete_leaves_no_empty_folders(tmp_path: Path, pushed: str) -> None:
    store, _ = open_snapshot_uri(pushed)
    store.delete_prefix("")
    assert not (tmp_path / "objects" / "snapshots" / "tiny").exists()
    assert (tmp_path / "objects" / "snapshots").is_dir()  # above the store's root: untouched
