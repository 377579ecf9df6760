"""The host-memory tier: models a worker unloaded, kept in RAM to re-warm without a disk read.

A scaled-to-zero deployment that comes back to the same worker skips fetch and load: its
weights are still in host memory (already prepacked on the CPU; pinned on CUDA so the copy
back to the device runs at full PCIe speed). Entries are evicted least-recently-used first
within a byte budget; a model bigger than the whole budget is not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.models.packed_linear import PackedLinear
from hotpool.worker.tokenizer import TextTokenizer


@dataclass(frozen=True)
class HostKey:
    digest: str  # the snapshot's manifest digest
    # What it was loaded as: one snapshot may be loaded in several dtypes and quantizations,
    # and a model held in one must never serve another.
    dtype: str
    quantization: str = "none"


@dataclass
class HostEntry:
    model: LlamaModel  # on the CPU (pinned when it came from CUDA)
    tokenizer: TextTokenizer
    nbytes: int


def model_bytes(model: LlamaModel) -> int:
    """Bytes of host memory the model's weights hold (shared storages counted once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    packed = sum(
        m.in_features * m.out_features * model.embed.weight.element_size()
        for m in model.modules()
        if isinstance(m, PackedLinear)
    )
    return sum(seen.values()) + packed


class HostModelCache:
    """LRU of unloaded models within ``budget_bytes`` (0 turns the tier off). Thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[HostKey, HostEntry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __contains__(self, key: HostKey) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: HostKey, model: LlamaModel, tokenizer: TextTokenizer) -> bool:
        """Keep ``model`` (moving it to pinned host memory if it is on a GPU); returns
        whether it was kept. Older entries are evicted to make room."""
        nbytes = model_bytes(model)
        if nbytes > self.budget_bytes:
            return False
        if next(model.parameters()).device.type != "cpu":
            model = _to_pinned_host(model)
        with self._lock:
            self._entries.pop(key, None)
            while self._entries and sum(e.nbytes for e in self._entries.values()) + nbytes > (
                self.budget_bytes
            ):
                self._entries.popitem(last=False)  # least recently used
            self._entries[key] = HostEntry(model, tokenizer, nbytes)
        return True

    def take(self, key: HostKey, device: torch.device) -> HostEntry | None:
        """Remove and return the entry for ``key`` with its model on ``device``, or None."""
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            return None
        if device.type != "cpu":
            entry.model.to(device, non_blocking=True)
            torch.cuda.synchronize(device)
        return entry


def _to_pinned_host(model: LlamaModel) -> LlamaModel:
    model.to("cpu")
    for t in [*model.parameters(), *model.buffers()]:
        t.data = t.data.pin_memory()
    return model
