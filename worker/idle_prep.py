"""What a worker does while it waits idle in the warm pool: the first load's one-time costs.

A worker's first load paid, besides reading its model, ~9 s to compile the CPU kernels on a
machine that had none (:mod:`hotpool.kernels.prebuild`) and ~1-1.5 s to import
``torch._dynamo``, which torch imports lazily the first time an op runs its Python reference
on the meta device (building the model's skeleton there does). Both are done here, in a
thread, as soon as the worker starts: a load that comes meanwhile waits for them (an import
lock, the kernels' build lock) instead of doing them again.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

import torch

from hotpool.kernels import prebuild

log = logging.getLogger(__name__)

# Modules a first load imports lazily, slow enough to show in a cold start.
LAZY_IMPORTS = ("torch._dynamo",)


def prepare(device: torch.device) -> None:
    start = time.perf_counter()
    for name in LAZY_IMPORTS:
        importlib.import_module(name)
    if device.type == "cpu":
        prebuild.build_all()
    log.debug("idle preparation done in %.2fs", time.perf_counter() - start)


def prepare_in_background(device: torch.device) -> threading.Thread:
    thread = threading.Thread(target=prepare, args=(device,), name="idle-prep", daemon=True)
    thread.start()
    return thread
