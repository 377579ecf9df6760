"""A WorkerService with a model already in place (no snapshot load, no HTTP), for tests that
drive the worker's request path: a real SmolLM2, or a tiny random model behind its tokenizer
(the weakest model there is: only a grammar or a budget ends its output)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from tiny_llama import TINY, tiny_model

from hotpool.worker.engine.async_engine import AsyncEngine
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.host_cache import HostKey
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.service import LoadedModel, WorkerService
from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.tokenizer import TextTokenizer

CPU = torch.device("cpu")


@contextmanager
def loaded_service(
    model: LlamaModel, tok: TextTokenizer, cache_dir: Path, dtype: str, config: EngineConfig
) -> Iterator[WorkerService]:
    engine = LLMEngine(model, CPU, config)
    svc = WorkerService(SnapshotCache(cache_dir), CPU)
    svc.loaded = LoadedModel(
        "d", "digest", tok, AsyncEngine(engine), model, HostKey("digest", dtype), False
    )
    try:
        yield svc
    finally:
        svc.loaded.engine.shutdown()


@contextmanager
def tiny_service(
    tokenizer_snapshot: Path, cache_dir: Path, vocab_size: int = 49152
) -> Iterator[WorkerService]:
    """The tiny random model behind the snapshot's tokenizer (``vocab_size``: its model's,
    SmolLM2's by default), which ends on that tokenizer's end tokens."""
    tok = TextTokenizer(tokenizer_snapshot)
    cfg = replace(TINY, vocab_size=vocab_size, eos_token_ids=tuple(tok.eos_token_ids))
    config = EngineConfig(kv_cache_bytes=16 << 20)
    with loaded_service(tiny_model(cfg=cfg), tok, cache_dir, "fp32", config) as svc:
        yield svc
