"""Errors of the snapshot subsystem.

One base class, so the worker's ``/load`` handler can turn any snapshot failure (bad URI,
missing object, corrupted file, unsupported GGUF) into one clear error for the control plane.
"""

from __future__ import annotations


class SnapshotError(Exception):
    """A snapshot cannot be read, verified, written or converted; the message says which part."""


class ObjectNotFoundError(SnapshotError):
    """The object store has no object under the requested key.

    Separate from other failures so callers can answer "no such snapshot" (a 4xx) rather than
    "the store is broken".
    """
