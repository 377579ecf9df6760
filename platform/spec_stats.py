"""Speculative decoding's figures per deployment, from its ready replicas' heartbeats.

Each worker reports the tokens its engine proposed and accepted since the model loaded, and
whether the automatic switch has speculation on now (``WorkerInfo``); the dashboard and the
control plane's ``/metrics`` show them summed per deployment. A replica that drains takes
its counts with it: these are the live replicas' figures, not a ledger.
"""

from __future__ import annotations

from dataclasses import dataclass

from hotpool.pool.pool import WorkerPool
from hotpool.pool.replica import ReplicaState


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    replicas: int = 0  # ready replicas that report speculation
    enabled_replicas: int = 0  # of which the switch has it on now

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


def deployment_spec_stats(pool: WorkerPool) -> dict[str, SpecStats]:
    """Per deployment, the sums over its ready replicas whose workers report speculation."""
    out: dict[str, SpecStats] = {}
    for r in pool.replicas():
        if r.state is not ReplicaState.READY:
            continue
        # The registry, not `replica.worker`: that is the registration, never refreshed.
        worker = pool.registry.get(r.handle.worker_id)
        info = None if worker is None else worker.info
        if info is None or info.spec_proposed is None or info.spec_accepted is None:
            continue
        s = out.setdefault(r.deployment, SpecStats())
        s.proposed += info.spec_proposed
        s.accepted += info.spec_accepted
        s.replicas += 1
        s.enabled_replicas += bool(info.spec_enabled)
    return out
