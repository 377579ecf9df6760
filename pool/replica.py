"""A replica: one worker holding one deployment's snapshot, and its lifecycle states."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum

from hotpool.pool.backend import WorkerHandle
from hotpool.pool.prefix_set import PrefixSet
from hotpool.worker.protocol import LoadResult, WorkerInfo


class ReplicaState(StrEnum):
    QUEUED = "queued"  # waiting for a worker slot (all max_workers are busy)
    COLD = "cold"  # claiming an idle worker, or a worker process starting
    LOADING = "loading"  # worker registered, snapshot loading
    READY = "ready"
    DRAINING = "draining"  # takes no new requests, finishes its own


@dataclass(eq=False)
class Replica:
    id: str
    deployment: str
    handle: WorkerHandle
    state: ReplicaState = ReplicaState.QUEUED
    worker: WorkerInfo | None = None
    load: LoadResult | None = None
    inflight: int = 0
    # Prompt tokens its requests have still to compute (the router's estimate, less cached
    # prefixes), until their first tokens: the replica's queued work, in tokens.
    queued_tokens: int = 0
    queued_output_tokens: int = 0  # output tokens its requests are expected to produce yet
    capacity: dict[str, float] = field(default_factory=dict)  # its worker's tokens/s curve
    kv_cache_usage: float | None = None  # its worker's last report
    created_at: float = field(default_factory=time.time)
    requested_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    cold_start_seconds: float | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None  # why the cold start failed, once it has
    replacement: bool = False  # stands in for a replica whose worker died
    generation: int = 1  # the deployment's generation it runs (a PATCH may start a new one)
    # Its deployment was deleted: it only finishes its requests, and no longer counts as the
    # name's (a new deployment may take the name at once, another tenant's too).
    retired: bool = False
    # The prompt prefixes its KV cache holds (its worker's heartbeats): cache-aware routing.
    prefixes: PrefixSet = field(default_factory=PrefixSet)

    @property
    def starting(self) -> bool:
        """Not ready yet, but on its way (a request may wait for it)."""
        return self.state in (ReplicaState.QUEUED, ReplicaState.COLD, ReplicaState.LOADING)

    @property
    def holds_worker(self) -> bool:
        """Counts against ``max_workers``: every state but waiting for a slot."""
        return self.state is not ReplicaState.QUEUED

    @property
    def address(self) -> str:
        if self.worker is None:
            raise RuntimeError(f"replica {self.id} has no registered worker yet")
        return self.worker.address

    def describe(self) -> dict[str, object]:
        """The replica as the deployments API shows it."""
        return {
            "id": self.id,
            "state": self.state.value,
            "worker_id": self.handle.worker_id,
            "pid": self.handle.pid,
            "inflight": self.inflight,
            "created_at": int(self.created_at),
            "cold_start_seconds": self.cold_start_seconds,
            "cold_start_phases": self.load.phases if self.load else None,
            "snapshot_cache_hit": self.load.cache_hit if self.load else None,
            "weights_tier": self.load.tier if self.load else None,  # remote, disk or host
            "generation": self.generation,
            "version": self.generation,  # the deployment version it runs
        }
