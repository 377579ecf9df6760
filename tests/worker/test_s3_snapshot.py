"""Snapshots pushed to a real S3-compatible server (moto on loopback) and fetched through the
worker's cache: verified copies, corruption, interrupted downloads, single-flight GETs, and
the real SmolLM2 generating after a trip through S3."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from s3_bucket import S3Bucket
from snapshot_folders import snapshot_folder
from test_s3_store import DroppingBody, make_store, payload, record_gets
from test_snapshot_cache import cache_entries

from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.manifest import MANIFEST_NAME, build_manifest
from hotpool.worker.snapshot.s3 import S3ObjectStore, parse_s3_uri
from hotpool.worker.snapshot.store import push_snapshot

PART = 64 << 10
WEIGHTS = payload(300 << 10)  # five 64 KiB ranged GETs


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return snapshot_folder(tmp_path / "local", WEIGHTS)


@pytest.fixture
def uri(s3_bucket: S3Bucket, local: Path) -> str:
    """A small snapshot pushed to the bucket with the default store (endpoint from the env)."""
    uri = s3_bucket.uri("snapshots/tiny")
    push_snapshot(local, uri)
    return uri


def cache_over(root: Path, store: S3ObjectStore) -> SnapshotCache:
    return SnapshotCache(root, open_store=lambda uri: (store, parse_s3_uri(uri)[1]))


def test_push_then_fetch_gives_identical_verified_files(
    uri: str, local: Path, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    keys = make_store(s3_bucket).list("snapshots/tiny/")
    cache = SnapshotCache(tmp_path / "cache")

    first = cache.fetch(uri)
    second = cache.fetch(uri)

    assert keys == [f"snapshots/tiny/{n}" for n in sorted(p.name for p in local.iterdir())]
    assert (first.cache_hit, second.cache_hit) == (False, True)
    for f in first.manifest.files:
        assert (first.path / f.path).read_bytes() == (local / f.path).read_bytes()
    assert first.manifest.digest == build_manifest(local, "llama", "bf16").digest


def test_a_corrupted_object_fails_naming_the_file_and_installs_nothing(
    uri: str, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    tampered = bytes([WEIGHTS[0] ^ 1]) + WEIGHTS[1:]
    boto3.client("s3", endpoint_url=s3_bucket.endpoint_url).put_object(
        Bucket=s3_bucket.name, Key="snapshots/tiny/model.safetensors", Body=tampered
    )
    cache = SnapshotCache(tmp_path / "cache")

    with pytest.raises(SnapshotError, match=r"'model\.safetensors' failed verification: sha256"):
        cache.fetch(uri)

    assert cache_entries(tmp_path / "cache") == []


def test_an_interrupted_download_leaves_nothing_and_succeeds_on_retry(
    uri: str, s3_bucket: S3Bucket, local: Path, tmp_path: Path
) -> None:
    store = make_store(s3_bucket, part_bytes=PART, max_concurrency=2, max_attempts=2)
    broken = True

    def remember_range(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        first_byte = (params.get("Range") or "bytes=0-").removeprefix("bytes=").split("-")[0]
        context["first_byte"] = int(first_byte)

    def drop_late_parts(parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        # The connection dies inside the weights' fourth part (and again when it resumes),
        # after earlier parts reached the disk.
        if broken and 3 * PART <= context["first_byte"] < 4 * PART:
            parsed["Body"] = DroppingBody(parsed["Body"], after=1000)

    store.client.meta.events.register("before-parameter-build.s3.GetObject", remember_range)
    store.client.meta.events.register("after-call.s3.GetObject", drop_late_parts)
    cache = cache_over(tmp_path / "cache", store)

    with pytest.raises(SnapshotError, match=r"model\.safetensors") as info:
        cache.fetch(uri)
    assert "ResponseStreamingError" in str(info.value)
    assert cache_entries(tmp_path / "cache") == []  # no digest folder, no temp folder

    broken = False
    snap = cache.fetch(uri)
    assert not snap.cache_hit
    assert (snap.path / "model.safetensors").read_bytes() == WEIGHTS


def test_eight_concurrent_fetches_download_each_file_once(
    uri: str, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    store = make_store(s3_bucket, part_bytes=PART, max_concurrency=4)
    gets = record_gets(store)
    cache = cache_over(tmp_path / "cache", store)
    start = threading.Barrier(8)
    results = []

    def fetch() -> None:
        start.wait(timeout=10)
        results.append(cache.fetch(uri))

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    files = Counter(g for g in gets if not g[0].endswith(MANIFEST_NAME))
    assert set(files.values()) == {1}  # no file and no range of one fetched twice
    per_file = Counter(key.removeprefix("snapshots/tiny/") for key, _ in files)
    assert per_file == {"config.json": 1, "tokenizer.json": 1, "model.safetensors": 5}
    assert sorted(r.cache_hit for r in results) == [False] + [True] * 7
    assert len({r.path for r in results}) == 1


@pytest.mark.slow
def test_smollm2_pushed_to_s3_loads_and_generates_like_the_local_copy(
    smollm2_snapshot_bf16: Path, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    from hotpool.worker.engine.base import EngineRequest
    from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
    from hotpool.worker.models.loader import load_model
    from hotpool.worker.protocol import SamplingParams
    from hotpool.worker.tokenizer import TextTokenizer

    uri = s3_bucket.uri("snapshots/smollm2")
    push_snapshot(smollm2_snapshot_bf16, uri)
    snap = SnapshotCache(tmp_path / "cache").fetch(uri)

    def greedy(folder: Path) -> list[int]:
        cpu = torch.device("cpu")
        engine = LLMEngine(load_model(folder, cpu), cpu, EngineConfig(kv_cache_bytes=16 << 20))
        ids = tuple(TextTokenizer(folder).encode("The capital of France is"))
        engine.add_request(
            EngineRequest("r", ids, SamplingParams(max_tokens=6, temperature=0.0), frozenset())
        )
        tokens: list[int] = []
        while engine.has_unfinished():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        return tokens

    tokens = greedy(snap.path)
    assert not snap.cache_hit and snap.manifest.total_bytes > 200_000_000
    assert len(tokens) == 6
    assert tokens == greedy(smollm2_snapshot_bf16)
    assert "Paris" in TextTokenizer(snap.path).decode(tokens)
