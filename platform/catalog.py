"""Deployments held in memory for the hot path and written through to SQL."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from hotpool.billing.deployments import DeploymentSpec, DeploymentStore


class DeploymentCatalog:
    """The router reads specs on every request and the autoscaler every second; neither
    should touch the database for that. All writes go through here, so the cache is exact
    for a single control plane."""

    def __init__(self, store: DeploymentStore) -> None:
        self.store = store
        self._specs: dict[str, DeploymentSpec] = {s.name: s for s in store.list()}

    def get(self, name: str) -> DeploymentSpec | None:
        return self._specs.get(name)

    def all(self) -> Mapping[str, DeploymentSpec]:
        return MappingProxyType(self._specs)

    def tenant_of(self, name: str) -> int | None:
        spec = self._specs.get(name)
        return spec.tenant_id if spec else None

    async def create(self, spec: DeploymentSpec) -> DeploymentSpec:
        """Raises ``DeploymentExists`` if the name is taken."""
        created = await asyncio.to_thread(self.store.create, spec)
        self._specs[created.name] = created
        return created

    async def update(self, name: str, changes: Mapping[str, Any]) -> DeploymentSpec:
        """Raises ``DeploymentNotFound``; the store bumps the generation when it must."""
        updated = await asyncio.to_thread(self.store.update, name, **changes)
        self._specs[name] = updated
        return updated

    async def delete(self, name: str) -> None:
        """Raises ``DeploymentNotFound``. Its usage stays in the ledger."""
        await asyncio.to_thread(self.store.delete, name)
        self._specs.pop(name, None)
