"""Which layers share a block table: the KV cache's layer groups (vLLM's hybrid KV cache idea).

A model whose layers all attend the same way (all full, or all sliding with one window) has
one group: one block table per request, and a page (block) of the cache holds K/V of every
layer for ``block_size`` positions. A model that mixes full and sliding layers (Gemma 3: five
sliding layers for each global one) cannot free the blocks behind the window with one table,
because the global layers still read them. So its layers are split into groups of equal size,
each group with one kind of attention and its own block table:

- the group size is the number of layers of the rarest kind (Gemma 3 270M: 3 global, 15
  sliding -> 1 full group and 5 sliding groups of 3 layers);
- a page holds ``slots`` layers (the group size), and layer ``i`` of every group lives in slot
  ``i``, so every group's pages come out of one shared pool of equal-sized pages and memory
  moves freely between groups as requests grow;
- a sliding group's table frees its blocks behind the window exactly as a sliding-only model
  does, while the full group keeps its whole table.

Where a kind's layers do not divide evenly, its last group is short and leaves slots of its
pages unused (Gemma 3 1B: 4 global, 22 sliding -> groups of 4, the sixth sliding group has 2).

Torch-free: the KV manager, the model runner and the attention backend all read this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class KVCacheGroups:
    """The split of a model's layers into block-table groups."""

    windows: tuple[int | None, ...]  # per group: its layers' window (None: full attention)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, in model order
    slots: int  # layers a page holds: the largest group's size

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layer_group(self) -> tuple[int, ...]:
        """Per layer: the group whose block table it reads."""
        return self._per_layer[0]

    @property
    def layer_slot(self) -> tuple[int, ...]:
        """Per layer: the slot of a page its K/V live in."""
        return self._per_layer[1]

    @cached_property
    def _per_layer(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        n = sum(len(g) for g in self.layers)
        group, slot = [0] * n, [0] * n
        for g, members in enumerate(self.layers):
            for s, layer in enumerate(members):
                group[layer], slot[layer] = g, s
        return tuple(group), tuple(slot)


def kv_cache_groups(layer_windows: Sequence[int | None]) -> KVCacheGroups:
    """Group layers by their attention window (``None`` = full), as the module docstring says.

    One kind of layer gives one group holding every layer in its own slot: the cache layout of
    a plain model, unchanged.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if window is not None and (isinstance(window, bool) or window <= 0):
            raise ValueError(f"layer {layer} has window {window!r}: give a positive int or None")
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        (window,) = kinds
        return KVCacheGroups((window,), (tuple(range(len(layer_windows))),), len(layer_windows))
    size = min(len(members) for members in kinds.values())
    windows: list[int | None] = []
    layers: list[tuple[int, ...]] = []
    # Full attention first, so that group 0 is the one whose table every position keeps.
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        members = kinds[window]
        for i in range(0, len(members), size):
            windows.append(window)
            layers.append(tuple(members[i : i + size]))
    return KVCacheGroups(tuple(windows), tuple(layers), size)
