"""The automatic off switch of speculative decoding.

Verifying k proposals costs k more positions in the forward pass: nearly free while a step
is bound by reading the weights (few sequences), a plain loss once the batch makes it
compute-bound (vLLM users report throughput losses at high batch;
``benchmarks/bench_spec.py`` measures the crossover that sets
``hotpool.worker.protocol.DEFAULT_MAX_BATCH``). Torch-free.
"""

from __future__ import annotations


class SpecSwitch:
    """On or off for the next step, from how many requests decode in it (see the module)."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.on = True
        self.num_switches = 0  # times it turned off or on: a flapping switch shows here

    def update(self, num_decoding: int) -> bool:
        if self.max_batch <= 0:
            return True
        was = self.on
        if self.on and num_decoding > self.max_batch:
            self.on = False
        elif not self.on and num_decoding <= max(1, self.max_batch // 2):
            self.on = True
        self.num_switches += was != self.on
        return self.on
