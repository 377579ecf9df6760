"""The host-memory tier: unloaded models kept in RAM, LRU within a byte budget."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_llama import tiny_model

from hotpool.worker.host_cache import HostKey, HostModelCache, model_bytes
from hotpool.worker.models.packed_linear import pack_linears, packing_available

CPU = torch.device("cpu")


def test_model_bytes_counts_weights_once_and_packed_copies() -> None:
    model = tiny_model()
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes(model) >= plain  # + rope tables (buffers)
    if packing_available(CPU, torch.bfloat16):
        bf16 = tiny_model().to(torch.bfloat16)
        before = model_bytes(bf16)
        pack_linears(bf16)
        assert model_bytes(bf16) == before  # packed copies replace the plain weights


def test_lru_eviction_within_the_budget(tmp_path: Path) -> None:
    size = model_bytes(tiny_model())
    cache = HostModelCache(budget_bytes=2 * size + size // 2)  # room for two
    models = {d: tiny_model(seed=i) for i, d in enumerate("abc")}
    tok = object()  # the cache never looks inside the tokenizer
    for d in "ab":
        assert cache.put(HostKey(d, "fp32"), models[d], tok)  # type: ignore[arg-type]
    assert HostKey("a", "fp32") in cache
    assert cache.put(HostKey("c", "fp32"), models["c"], tok)  # type: ignore[arg-type]
    assert HostKey("a", "fp32") not in cache  # the least recently used went
    assert cache.used_bytes <= cache.budget_bytes
    entry = cache.take(HostKey("b", "fp32"), CPU)
    assert entry is not None and entry.model is models["b"]  # the very object: no copy
    assert cache.take(HostKey("b", "fp32"), CPU) is None  # taken: the worker owns it now
    assert cache.take(HostKey("c", "bf16"), CPU) is None  # another dtype is another entry
    assert HostKey("c", "fp32") == HostKey("c", "fp32", "none")
    assert cache.take(HostKey("c", "fp32", "int8"), CPU) is None  # and another quantization
    assert HostKey("c", "fp32") in cache


def test_a_model_bigger_than_the_budget_is_not_kept() -> None:
    cache = HostModelCache(budget_bytes=10)
    assert not cache.put(HostKey("a", "fp32"), tiny_model(), object())  # type: ignore[arg-type]
    assert cache.used_bytes == 0
    off = HostModelCache(budget_bytes=0)
    assert not off.put(HostKey("a", "fp32"), tiny_model(), object())  # type: ignore[arg-type]
