"""Where worker processes come from: the backend interface and its handle."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerHandle:
    """A started worker as its backend knows it (before and after it registers)."""

    worker_id: str
    pid: int | None = None
    log_path: str | None = None


class WorkerBackend(ABC):
    """Starts and stops worker processes somewhere (this machine, a Ray cluster).

    Contract: :meth:`start` returns once the process is launched, not once it is ready; the
    worker then registers with the control plane by itself (``/internal/workers/register``)
    under the given ``worker_id``. :meth:`stop` is idempotent and returns once the process
    is gone. :meth:`exit_reason` is ``None`` while the process lives, else why it ended.
    """

    @abstractmethod
    async def start(self, worker_id: str) -> WorkerHandle: ...

    @abstractmethod
    async def stop(self, handle: WorkerHandle, grace_s: float = 10.0) -> None: ...

    @abstractmethod
    def exit_reason(self, handle: WorkerHandle) -> str | None: ...
