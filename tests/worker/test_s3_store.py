"""The S3 object store against a real S3-compatible HTTP server (moto) on loopback: the
ObjectStore contract, multipart upload, parallel ranged GETs, a dropped stream, and one clear
error for each way the store can be unreachable."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore.exceptions as bce
import pytest
from s3_bucket import S3Bucket
from snapshot_folders import check_store_contract

from hotpool.settings import load_settings
from hotpool.worker.snapshot.errors import ObjectNotFoundError, SnapshotError
from hotpool.worker.snapshot.s3 import MIB, S3Config, S3ObjectStore

KIB = 1 << 10


def make_store(bucket: S3Bucket, **config: Any) -> S3ObjectStore:
    """A store with its own boto3 client, so event hooks stay in this test."""
    return S3ObjectStore(bucket.name, S3Config(endpoint_url=bucket.endpoint_url, **config))


def record_gets(store: S3ObjectStore) -> list[tuple[str, str | None]]:
    """(key, Range) of every GetObject the store's client sends."""
    gets: list[tuple[str, str | None]] = []

    def hook(params: dict[str, Any], **_: Any) -> None:
        gets.append((params["Key"], params.get("Range")))

    store.client.meta.events.register("before-parameter-build.s3.GetObject", hook)
    return gets


class DroppingBody:
    """A response body whose connection drops after ``after`` bytes."""

    def __init__(self, inner: Any, after: int) -> None:
        self.inner, self.left = inner, after

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            raise bce.ResponseStreamingError(error=ConnectionResetError("connection reset"))
        chunk = self.inner.read(min(n, self.left) if n > 0 else self.left)
        self.left -= len(chunk)
        return chunk

    def close(self) -> None:
        self.inner.close()


def drop_streams(store: S3ObjectStore, times: int, after: int = 1000) -> list[int]:
    """Make the next ``times`` GET bodies drop mid-stream; returns a counter of drops."""
    dropped = [0]

    def hook(parsed: dict[str, Any], **_: Any) -> None:
        if dropped[0] < times and "Body" in parsed:
            dropped[0] += 1
            parsed["Body"] = DroppingBody(parsed["Body"], after)

    store.client.meta.events.register("after-call.s3.GetObject", hook)
    return dropped


def payload(n: int) -> bytes:
    return bytes(i * 7 % 251 for i in range(n))


@pytest.fixture
def store(s3_bucket: S3Bucket) -> S3ObjectStore:
    return make_store(s3_bucket, part_bytes=64 * KIB, max_concurrency=4)


def test_round_trip_list_exists_and_delete(store: S3ObjectStore, tmp_path: Path) -> None:
    check_store_contract(store, tmp_path)
    store.delete(["snaps/ab/model.bin", "snaps/never-there"])
    assert store.list("") == []
    with pytest.raises(ObjectNotFoundError, match=r"s3://hotpool-\w+/snaps/a/model.bin"):
        store.get_bytes("snaps/a/model.bin")


def test_empty_object_downloads_without_a_get(store: S3ObjectStore, tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    store.upload(tmp_path / "empty", "empty")
    gets = record_gets(store)
    store.download("empty", tmp_path / "out", None)
    assert (tmp_path / "out").read_bytes() == b"" and gets == []


def test_large_object_multipart_up_and_parallel_ranged_gets_down(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    data = payload(11 * MIB + 123)
    (tmp_path / "big").write_bytes(data)
    uploader = make_store(s3_bucket, part_bytes=5 * MIB)
    parts_uploaded: list[int] = []
    uploader.client.meta.events.register(
        "before-parameter-build.s3.UploadPart",
        lambda params, **_: parts_uploaded.append(params["PartNumber"]),
    )
    uploader.upload(tmp_path / "big", "weights/model.safetensors")

    store = make_store(s3_bucket, part_bytes=1 * MIB, max_concurrency=4)
    gets = record_gets(store)
    chunks: list[bytes] = []
    store.download("weights/model.safetensors", tmp_path / "out", chunks.append)

    assert sorted(parts_uploaded) == [1, 2, 3]  # multipart: 5 + 5 + 1 MiB
    assert (tmp_path / "out").read_bytes() == data
    assert b"".join(chunks) == data  # handed over in order, so a hash of chunks is right
    expected = [f"bytes={s}-{min(s + MIB, len(data)) - 1}" for s in range(0, len(data), MIB)]
    assert sorted(r for _, r in gets) == sorted(expected)  # each range fetched exactly once


def test_a_dropped_stream_resumes_where_it_stopped(store: S3ObjectStore, tmp_path: Path) -> None:
    data = payload(200 * KIB)
    (tmp_path / "src").write_bytes(data)
    store.upload(tmp_path / "src", "model.safetensors")
    store.upload(tmp_path / "src", "manifest.json")
    gets = record_gets(store)

    # The parts (three of 64 KiB, one of 8 KiB) are fetched in parallel and any of them may
    # answer first, so the drop comes before the shortest part ends.
    dropped = drop_streams(store, times=1, after=4_000)
    store.download("model.safetensors", tmp_path / "out", None)
    assert (tmp_path / "out").read_bytes() == data
    assert dropped == [1]
    assert len(gets) == 4 + 1  # four parts, one of them fetched again from where it stopped
    resumed = [r for _, r in gets if r is not None and int(r[6:].split("-")[0]) % (64 * KIB)]
    assert len(resumed) == 1 and int(resumed[0][6:].split("-")[0]) % (64 * KIB) == 4_000

    drop_streams(store, times=1, after=10_000)
    assert store.get_bytes("manifest.json") == data
    assert gets[-2:] == [("manifest.json", None), ("manifest.json", "bytes=10000-")]


def test_a_stream_that_keeps_dropping_fails_with_one_clear_error(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    store = make_store(s3_bucket, max_attempts=2)
    (tmp_path / "src").write_bytes(payload(5000))
    store.upload(tmp_path / "src", "model.safetensors")
    drop_streams(store, times=100)

    with pytest.raises(SnapshotError) as info:
        store.download("model.safetensors", tmp_path / "out", None)
    assert_one_clear_error(info, "s3://hotpool-", "model.safetensors", "ResponseStreamingError")


def assert_one_clear_error(info: pytest.ExceptionInfo[SnapshotError], *parts: str) -> None:
    message = str(info.value)
    for part in parts:
        assert part in message
    assert "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_missing_bucket_is_named(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = S3ObjectStore("no-such-bucket", S3Config(endpoint_url=s3_bucket.endpoint_url))
    (tmp_path / "src").write_bytes(b"weights")
    for call in (
        lambda: store.upload(tmp_path / "src", "snap/model.safetensors"),
        lambda: store.get_bytes("snap/manifest.json"),
        lambda: store.download("snap/model.safetensors", tmp_path / "x", None),
        lambda: store.list("snap/"),
    ):
        with pytest.raises(SnapshotError) as info:
            call()
        assert not isinstance(info.value, ObjectNotFoundError)
        assert_one_clear_error(info, "S3 bucket 'no-such-bucket' does not exist", "s3://no-such")


def test_missing_key_is_object_not_found(store: S3ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFoundError) as info:
        store.download("snap/model.safetensors", tmp_path / "x", None)
    assert_one_clear_error(info, f"no object s3://{store.bucket}/snap/model.safetensors")
    assert not store.exists("snap/model.safetensors")


def test_credentials_the_server_rejects(store: S3ObjectStore, tmp_path: Path) -> None:
    from moto.core.authorization import enable_iam_authentication

    with enable_iam_authentication(), pytest.raises(SnapshotError) as info:
        store.get_bytes("snap/manifest.json")
    assert_one_clear_error(info, "S3 rejected the credentials", "InvalidAccessKeyId")
    with enable_iam_authentication(), pytest.raises(SnapshotError) as info:
        store.download("snap/model.safetensors", tmp_path / "x", None)
    assert_one_clear_error(info, "access denied", "AWS_ACCESS_KEY_ID", "model.safetensors")


def test_no_credentials_at_all(
    s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    store = make_store(s3_bucket)
    with pytest.raises(SnapshotError) as info:
        store.get_bytes("snap/manifest.json")
    assert_one_clear_error(info, "no usable AWS credentials", "AWS_ACCESS_KEY_ID", "snap/manifest")


@pytest.fixture
def dead_endpoint() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield f"http://127.0.0.1:{port}"


def test_unreachable_endpoint(dead_endpoint: str, s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = S3ObjectStore("bucket", S3Config(endpoint_url=dead_endpoint, max_attempts=1))
    with pytest.raises(SnapshotError) as info:
        store.download("snap/model.safetensors", tmp_path / "x", None)
    assert_one_clear_error(info, "unreachable", dead_endpoint, "s3://bucket/snap/model")


def test_the_endpoint_comes_from_hotpool_or_the_aws_variables(tmp_path: Path) -> None:
    assert S3Config.from_env({}).endpoint_url is None  # AWS S3 itself
    assert S3Config.from_env({"AWS_ENDPOINT_URL": "http://minio:9000/"}).endpoint_url == (
        "http://minio:9000"
    )
    both = {"HOTPOOL_S3_ENDPOINT_URL": "https://r2.example", "AWS_ENDPOINT_URL": "http://x:1"}
    assert S3Config.from_env(both).endpoint_url == "https://r2.example"
    with pytest.raises(SnapshotError, match="HOTPOOL_S3_ENDPOINT_URL='minio:9000' is invalid"):
        S3Config.from_env({"HOTPOOL_S3_ENDPOINT_URL": "minio:9000"})
    settings = load_settings({"HOTPOOL_HOME": str(tmp_path), "AWS_ENDPOINT_URL_S3": "http://a:1"})
    assert settings.s3_endpoint_url == "http://a:1"


class _RawBody:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


def test_throttling_is_retried_with_backoff(store: S3ObjectStore, tmp_path: Path) -> None:
    from botocore.awsrequest import AWSResponse

    (tmp_path / "src").write_bytes(b"weights")
    store.upload(tmp_path / "src", "model.safetensors")
    sent: list[int] = []

    def slow_down_once(request: Any, **_: Any) -> AWSResponse | None:
        sent.append(1)
        if len(sent) > 1:
            return None  # really send it
        body = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"
        return AWSResponse(request.url, 503, {}, _RawBody(body))

    store.client.meta.events.register("before-send.s3.GetObject", slow_down_once)
    assert store.get_bytes("model.safetensors") == b"weights"
    assert len(sent) == 2
