"""Speculative decoding's figures per deployment, from its replicas' heartbeats.

Each worker reports the tokens its engine proposed and accepted since the model loaded, and
whether the automatic switch has speculation on now (``WorkerInfo``).
:func:`deployment_spec_stats` sums the ready replicas' reports: the control plane's
``/metrics`` gauges, which drop when a replica drains. The dashboard reads a
:class:`SpecTally` instead: it keeps each replica's last report and, once the replica is
gone, adds it to its deployment's sum, so a deployment scaled to zero still shows the rate
its replicas had. The tally lives in the control plane's memory (a restart starts it
afresh); it is fed by every heartbeat and by every read, so what a replica counted after its
last heartbeat (2 s at most) is all it misses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from hotpool.billing.deployments import DeploymentSpec
from hotpool.pool.pool import WorkerPool
from hotpool.pool.replica import Replica, ReplicaState
from hotpool.worker.protocol import WorkerInfo


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    replicas: int = 0  # ready replicas that report speculation
    enabled_replicas: int = 0  # of which the switch has it on now

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


def _report(pool: WorkerPool, replica: Replica) -> WorkerInfo | None:
    """The last heartbeat of the replica's worker, if it reports speculation for the
    replica's deployment (a worker just handed over may still report its previous model)."""
    # The registry, not `replica.worker`: that is the registration, never refreshed.
    worker = pool.registry.get(replica.handle.worker_id)
    info = None if worker is None else worker.info
    if info is None or info.loaded != replica.deployment:
        return None
    if info.spec_proposed is None or info.spec_accepted is None:
        return None
    return info


def deployment_spec_stats(pool: WorkerPool) -> dict[str, SpecStats]:
    """Per deployment, the sums over its ready replicas whose workers report speculation."""
    out: dict[str, SpecStats] = {}
    for r in pool.replicas():
        info = _report(pool, r) if r.state is ReplicaState.READY else None
        if info is None:
            continue
        s = out.setdefault(r.deployment, SpecStats())
        s.proposed += info.spec_proposed or 0
        s.accepted += info.spec_accepted or 0
        s.replicas += 1
        s.enabled_replicas += bool(info.spec_enabled)
    return out


@dataclass(frozen=True)
class _Owner:
    """Which deployment a count belongs to: a deleted deployment's name may be taken again
    at once, another tenant's too, and the new one must not inherit its figures."""

    tenant_id: int
    created_at: datetime | None


def _owner(spec: DeploymentSpec) -> _Owner:
    return _Owner(spec.tenant_id, spec.created_at)


@dataclass
class _Counts:
    owner: _Owner
    proposed: int = 0
    accepted: int = 0


class SpecTally:
    """Proposed and accepted tokens per deployment over every replica this control plane
    has seen report them, live or gone."""

    def __init__(self) -> None:
        # Replica id -> its deployment and its last report.
        self._latest: dict[str, tuple[str, _Counts]] = {}
        self._gone: dict[str, _Counts] = {}  # deployment -> its replicas that went

    def observe(self, pool: WorkerPool, specs: Mapping[str, DeploymentSpec]) -> None:
        """Take each replica's last report, and fold those of replicas that went into their
        deployment's sum. ``specs``: every deployment that exists now (all tenants')."""
        present: set[str] = set()
        for r in pool.replicas():  # never a deleted deployment's: they drain out of sight
            present.add(r.id)
            info, spec = _report(pool, r), specs.get(r.deployment)
            if info is not None and spec is not None:
                counts = _Counts(_owner(spec), info.spec_proposed or 0, info.spec_accepted or 0)
                self._latest[r.id] = (r.deployment, counts)
        for replica_id in [i for i in self._latest if i not in present]:
            self._fold(*self._latest.pop(replica_id), specs)
        for name in [n for n, c in self._gone.items() if not _owns(specs.get(n), c)]:
            del self._gone[name]  # deleted (or deleted and taken again): its figures go

    def _fold(self, name: str, counts: _Counts, specs: Mapping[str, DeploymentSpec]) -> None:
        if not _owns(specs.get(name), counts):
            return
        gone = self._gone.get(name)
        if gone is None or gone.owner != counts.owner:
            self._gone[name] = counts
        else:
            gone.proposed += counts.proposed
            gone.accepted += counts.accepted

    def stats(self, pool: WorkerPool, specs: Mapping[str, DeploymentSpec]) -> dict[str, SpecStats]:
        """Per deployment: proposed and accepted over its replicas live (draining ones too)
        and gone; its ready replicas, and the switch on them, as they are now."""
        self.observe(pool, specs)
        out: dict[str, SpecStats] = {}
        for name, counts in [*self._latest.values(), *self._gone.items()]:
            s = out.setdefault(name, SpecStats())
            s.proposed += counts.proposed
            s.accepted += counts.accepted
        for name, ready in deployment_spec_stats(pool).items():
            s = out.setdefault(name, SpecStats())
            s.replicas, s.enabled_replicas = ready.replicas, ready.enabled_replicas
        return out


def _owns(spec: DeploymentSpec | None, counts: _Counts) -> bool:
    return spec is not None and _owner(spec) == counts.owner
