"""Snapshots in S3 and S3-compatible stores (MinIO, Cloudflare R2, Ceph) through boto3.

Downloads split large objects into ranged GETs fetched by a small thread pool and hand the
parts to the caller in order, so the cache hashes while bytes arrive and the file is written
once. Every ranged GET carries the ETag from the first HEAD (``If-Match``): an object replaced
mid-download fails cleanly instead of splicing two versions. Throttling and transient HTTP
errors are retried by botocore; a connection dropped mid-body (which botocore does not retry)
is retried here, part by part.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions as bce
import urllib3.exceptions
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig

from hotpool.settings import SettingsError, s3_endpoint_url
from hotpool.worker.snapshot.errors import ObjectNotFoundError, SnapshotError
from hotpool.worker.snapshot.s3_errors import s3_error
from hotpool.worker.snapshot.store import ObjectStore

MIB = 1 << 20

# Errors while reading a response body: the request succeeded, the connection did not last.
_STREAM_ERRORS: tuple[type[BaseException], ...] = (
    bce.ResponseStreamingError,
    bce.IncompleteReadError,
    bce.ReadTimeoutError,
    bce.ConnectionClosedError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    ConnectionError,
)


@dataclass(frozen=True)
class S3Config:
    """How to reach the store and how hard to push it; credentials and region come from the
    standard AWS chain (environment, profile, instance or container role)."""

    endpoint_url: str | None = None  # None: AWS S3; set for MinIO, R2, moto
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION / profile
    part_bytes: int = 8 * MIB  # ranged GET and multipart upload part size
    max_concurrency: int = 8  # parts in flight per object
    max_attempts: int = 5  # per request, botocore's retries and ours for a dropped stream
    retry_mode: str = "standard"  # botocore: "standard" or "adaptive" (client-side rate limit)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if min(self.part_bytes, self.max_concurrency, self.max_attempts) < 1:
            raise ValueError("part_bytes, max_concurrency and max_attempts must be >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Config:
        """The endpoint from ``HOTPOOL_S3_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL[_S3]``)."""
        try:
            return cls(endpoint_url=s3_endpoint_url(env))
        except SettingsError as exc:
            raise SnapshotError(str(exc)) from None


def make_client(config: S3Config) -> Any:
    """A new boto3 S3 client for ``config`` (thread-safe; share it between threads)."""
    options: dict[str, Any] = {}
    if config.endpoint_url:
        # MinIO and most S3-compatible servers only route path-style requests.
        options["addressing_style"] = "path"
    boto_config = BotoConfig(
        retries={"max_attempts": config.max_attempts, "mode": config.retry_mode},
        max_pool_connections=max(10, 2 * config.max_concurrency),
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        s3=options,
    )
    session = boto3.session.Session(region_name=config.region)
    return session.client("s3", endpoint_url=config.endpoint_url, config=boto_config)


@lru_cache(maxsize=8)
def shared_client(config: S3Config) -> Any:
    """One client per config for the process: creating one costs ~0.1 s of a cold start."""
    return make_client(config)


@dataclass(frozen=True)
class _Head:
    size: int
    etag: str


class S3ObjectStore(ObjectStore):
    """The :class:`ObjectStore` contract over one S3 bucket.

    Keys are full object keys in ``bucket``. ``client`` defaults to a new boto3 client built
    from ``config``; pass one to share connections or to hook its events in tests.
    """

    def __init__(self, bucket: str, config: S3Config | None = None, client: Any = None) -> None:
        self.bucket = bucket
        self.config = config or S3Config()
        self.client = client if client is not None else make_client(self.config)

    def _uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _fail(
        self, exc: BaseException, action: str, key: str | None = None, bucket_request: bool = False
    ) -> SnapshotError:
        endpoint = self.client.meta.endpoint_url
        return s3_error(exc, action, self.bucket, key, endpoint, bucket_request)

    def get_bytes(self, key: str) -> bytes:
        return b"".join(self._read_range(key, None, None))

    def download(
        self, key: str, dest: Path, chunk_cb: Callable[[bytes], None] | None = None
    ) -> None:
        head = self._head(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        # closing(): a failing chunk_cb stops the part fetchers now, not when GC runs.
        with dest.open("wb") as out, contextlib.closing(self._parts(key, head)) as parts:
            for part in parts:
                if chunk_cb is not None:
                    chunk_cb(part)
                out.write(part)

    def upload(self, src: Path, key: str) -> None:
        transfer = TransferConfig(
            multipart_threshold=self.config.part_bytes,
            multipart_chunksize=max(self.config.part_bytes, 5 * MIB),  # S3's minimum part
            max_concurrency=self.config.max_concurrency,
        )
        try:
            # PutObject and CompleteMultipartUpload both publish the object whole or not at all.
            self.client.upload_file(str(src), self.bucket, key, Config=transfer)
        except (bce.BotoCoreError, bce.ClientError, Boto3Error) as exc:
            raise self._fail(exc, "upload", key) from None

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                keys.extend(obj["Key"] for obj in page.get("Contents", ()))
        except (bce.BotoCoreError, bce.ClientError) as exc:
            raise self._fail(exc, "list", prefix) from None
        return sorted(keys)

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except ObjectNotFoundError:
            return False
        return True

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            try:
                out = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            except (bce.BotoCoreError, bce.ClientError) as exc:
                raise self._fail(exc, "delete", keys[start]) from None
            if out.get("Errors"):
                err = out["Errors"][0]
                raise SnapshotError(
                    f"cannot delete {self._uri(err['Key'])}: {err.get('Code')}: "
                    f"{err.get('Message')}"
                )

    def _head(self, key: str) -> _Head:
        try:
            out = self.client.head_object(Bucket=self.bucket, Key=key)
        except (bce.BotoCoreError, bce.ClientError) as exc:
            # HEAD answers have no body, so a 404 does not say whether the bucket exists.
            if isinstance(exc, bce.ClientError) and _status(exc) == 404:
                self._check_bucket(key)
            raise self._fail(exc, "read", key) from None
        return _Head(int(out["ContentLength"]), out["ETag"])

    def _check_bucket(self, key: str) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (bce.BotoCoreError, bce.ClientError) as exc:
            raise self._fail(exc, "read", key, bucket_request=True) from None

    def _parts(self, key: str, head: _Head) -> Iterator[bytes]:
        """The object's bytes as parts in order. At most ``max_concurrency + 2`` parts are in
        flight or waiting (80 MiB with the defaults): enough that a slow part at the head
        does not idle every fetcher, bounded so a large file never sits in memory."""
        part = self.config.part_bytes
        ranges = [(start, min(start + part, head.size)) for start in range(0, head.size, part)]
        if len(ranges) <= 1:
            for start, end in ranges:
                yield b"".join(self._read_range(key, (start, end), head.etag))
            return
        workers = min(self.config.max_concurrency, len(ranges))
        pending: deque[Future[bytes]] = deque()
        todo = iter(ranges)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="hotpool-s3-get")
        try:
            for rng in todo:
                pending.append(pool.submit(self._read_part, key, rng, head.etag))
                if len(pending) >= workers + 2:
                    break
            while pending:
                data = pending.popleft().result()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append(pool.submit(self._read_part, key, nxt, head.etag))
                yield data
        finally:
            # On an error (ours or the caller's chunk_cb) stop fetching parts nobody will read.
            pool.shutdown(wait=True, cancel_futures=True)

    def _read_part(self, key: str, rng: tuple[int, int], etag: str) -> bytes:
        return b"".join(self._read_range(key, rng, etag))

    def _read_range(
        self, key: str, rng: tuple[int, int] | None, etag: str | None
    ) -> Iterator[bytes]:
        """GET ``[start, end)`` of ``key`` (all of it when ``rng`` is None), retrying a dropped
        stream from the first byte not yet received."""
        start, end = rng if rng is not None else (0, None)
        got = 0
        for attempt in range(1, self.config.max_attempts + 1):
            args: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
            if rng is not None or got:
                last = "" if end is None else str(end - 1)
                args["Range"] = f"bytes={start + got}-{last}"
            if etag is not None:
                args["IfMatch"] = etag
            try:
                out = self.client.get_object(**args)
                etag = etag or out["ETag"]  # a resumed read must continue the same version
                body = out["Body"]
                try:
                    while chunk := body.read(1 << 20):
                        got += len(chunk)
                        yield chunk
                finally:
                    body.close()
                return
            except _STREAM_ERRORS as exc:
                if attempt == self.config.max_attempts:
                    raise self._fail(exc, "read", key) from None
                _backoff(attempt)
            except (bce.BotoCoreError, bce.ClientError) as exc:
                raise self._fail(exc, "read", key) from None


def _status(exc: bce.ClientError) -> int | None:
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


_jitter = random.Random()
_jitter_lock = threading.Lock()


def _backoff(attempt: int) -> None:
    """Full-jitter exponential backoff: up to 0.1 s, 0.2 s, 0.4 s ... capped at 5 s."""
    with _jitter_lock:
        delay = _jitter.uniform(0, min(5.0, 0.1 * 2 ** (attempt - 1)))
    time.sleep(delay)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")`` (``""`` at the root)."""
    rest = uri.removeprefix("s3://")
    bucket, _, path = rest.partition("/")
    if not bucket or "?" in rest or "#" in rest:
        raise SnapshotError(f"snapshot URI {uri!r} must look like s3://bucket/prefix")
    path = path.strip("/")
    return bucket, (path + "/" if path else "")


def open_s3_uri(uri: str, config: S3Config | None = None) -> tuple[S3ObjectStore, str]:
    """The store for ``uri``'s bucket (sharing one client per config) and the key prefix."""
    bucket, prefix = parse_s3_uri(uri)
    config = config or S3Config.from_env(os.environ)
    return S3ObjectStore(bucket, config, client=shared_client(config)), prefix
