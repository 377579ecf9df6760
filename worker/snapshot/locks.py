"""Advisory file locks that coordinate worker processes sharing one snapshot cache folder.

``flock`` locks belong to an open file, so two opens conflict even inside one process, and
the kernel drops them when a process dies: a crashed worker never leaves a lock held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

SHARED = fcntl.LOCK_SH
EXCLUSIVE = fcntl.LOCK_EX


def acquire(path: Path, mode: int) -> int:
    """Open ``path`` (creating it) and lock it, waiting if needed; the fd holds the lock until
    closed."""
    fd = try_acquire(path, mode, blocking=True)
    if fd is None:  # unreachable: a blocking flock either locks or raises
        raise OSError(f"could not lock {path}")
    return fd


def try_acquire(path: Path, mode: int, blocking: bool = False) -> int | None:
    """Like :func:`acquire`; without ``blocking``, None when another open file holds a
    conflicting lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode if blocking else mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def held(path: Path, mode: int, blocking: bool = True) -> Iterator[bool]:
    """``with held(p, EXCLUSIVE, blocking=False) as got:`` -- ``got`` says whether it is held."""
    fd = try_acquire(path, mode, blocking)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)
