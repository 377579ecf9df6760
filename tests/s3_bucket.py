"""The type of the ``s3_bucket`` fixture (tests/conftest.py), importable by test modules.

A plain module, not ``conftest``: with several conftest.py files in the suite, ``from
conftest import ...`` may find another folder's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class S3Bucket:
    """An empty bucket on the loopback S3 server; boto3 in this test reaches it by default."""

    endpoint_url: str
    name: str

    def uri(self, path: str = "") -> str:
        return f"s3://{self.name}/{path}".rstrip("/")
