"""Deployments held in memory for the hot path and written through to SQL."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from hotpool.billing.deployments import DeploymentSpec, DeploymentStore
from hotpool.billing.versions import VersionRecord


class DeploymentCatalog:
    """The router reads specs on every request and the autoscaler every second; neither
    should touch the database for that. All writes go through here, so the cache is exact
    for a single control plane. Versions are immutable, so the canary versions' records are
    cached for good once read."""

    def __init__(self, store: DeploymentStore) -> None:
        self.store = store
        self._specs: dict[str, DeploymentSpec] = {s.name: s for s in store.list()}
        self._versions: dict[tuple[str, int], VersionRecord] = {}
        for spec in self._specs.values():
            if spec.canary_version is not None:
                self._cache_version(spec.name, spec.canary_version)

    def get(self, name: str) -> DeploymentSpec | None:
        return self._specs.get(name)

    def all(self) -> Mapping[str, DeploymentSpec]:
        return MappingProxyType(self._specs)

    def tenant_of(self, name: str) -> int | None:
        spec = self._specs.get(name)
        return spec.tenant_id if spec else None

    def canary_of(self, spec: DeploymentSpec) -> DeploymentSpec | None:
        """``spec``'s canary version as its replicas run it, or None without a canary."""
        if spec.canary_version is None:
            return None
        record = self._versions.get((spec.name, spec.canary_version))
        return None if record is None else spec.at_version(record)

    async def create(self, spec: DeploymentSpec, created_by: str | None = None) -> DeploymentSpec:
        """Raises ``DeploymentExists`` if the name is taken."""
        created = await asyncio.to_thread(self.store.create, spec, created_by)
        self._specs[created.name] = created
        return created

    async def update(
        self, name: str, changes: Mapping[str, Any], created_by: str | None = None
    ) -> DeploymentSpec:
        """Raises ``DeploymentNotFound``; a change of what replicas run is a new version."""
        return await self._write(self.store.update, name, created_by=created_by, **changes)

    async def add_canary(
        self, name: str, percent: float, changes: Mapping[str, Any], created_by: str | None
    ) -> DeploymentSpec:
        return await self._write(
            self.store.add_canary, name, percent, created_by=created_by, **changes
        )

    async def set_canary(
        self, name: str, version: int | None, percent: float | None
    ) -> DeploymentSpec:
        return await self._write(self.store.set_canary, name, version, percent)

    async def promote(self, name: str) -> DeploymentSpec:
        return await self._write(self.store.promote, name)

    async def rollback(self, name: str) -> DeploymentSpec:
        return await self._write(self.store.rollback, name)

    async def delete(self, name: str) -> None:
        """Raises ``DeploymentNotFound``. Its usage stays in the ledger."""
        await asyncio.to_thread(self.store.delete, name)
        self._specs.pop(name, None)
        for key in [k for k in self._versions if k[0] == name]:
            del self._versions[key]

    async def _write(
        self, op: Callable[..., DeploymentSpec], name: str, *args: Any, **kwargs: Any
    ) -> DeploymentSpec:
        def run() -> DeploymentSpec:
            spec = op(name, *args, **kwargs)
            if spec.canary_version is not None:
                self._cache_version(name, spec.canary_version)
            return spec

        # The version record is read before the new spec is published, so a request that
        # sees the canary always finds its version.
        spec = await asyncio.to_thread(run)
        self._specs[name] = spec
        return spec

    def _cache_version(self, name: str, version: int) -> None:
        if (name, version) not in self._versions:
            self._versions[(name, version)] = self.store.version(name, version)
