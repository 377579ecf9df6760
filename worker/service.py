"""What a worker does, independent of HTTP: load a snapshot, generate, unload.

A worker holds at most one loaded deployment (it is then a replica of it). Loading is a
timed cold start: fetch the snapshot into the local cache (skipped on a hit), load weights,
warm up with one short forward pass. A model the worker unloads stays in host memory
(:class:`HostModelCache`, within a budget), so loading it again skips fetch and load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import torch

from hotpool.worker.detokenizer import IncrementalDetokenizer
from hotpool.worker.engine.async_engine import AsyncEngine
from hotpool.worker.engine.base import EngineRequest, RequestRejected
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.host_cache import HostKey, HostModelCache
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.models.loader import DTYPES, load_model
from hotpool.worker.protocol import (
    GenerateEvent,
    GenerateRequest,
    LoadRequest,
    LoadResult,
    SamplingParams,
    Usage,
)
from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.tokenizer import TextTokenizer


class NotLoaded(RuntimeError):
    """No snapshot is loaded on this worker."""


@dataclass
class LoadedModel:
    deployment: str
    digest: str
    tokenizer: TextTokenizer
    engine: AsyncEngine
    model: LlamaModel
    host_key: HostKey
    pinned: bool  # holds a pin on its snapshot in the disk cache


def pick_device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 wherever it is fast: CUDA, and CPUs with native bf16 (PERF_NOTES: 5-15x fp32)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if torch.backends.mkldnn.is_available() else torch.float32


class WorkerService:
    def __init__(
        self,
        cache: SnapshotCache,
        device: torch.device,
        engine_config: EngineConfig | None = None,
        host_cache: HostModelCache | None = None,
    ) -> None:
        self.cache = cache
        self.device = device
        self.engine_config = engine_config or EngineConfig()
        self.host_cache = host_cache or HostModelCache(0)
        self.loaded: LoadedModel | None = None
        self._lock = asyncio.Lock()

    async def load(self, req: LoadRequest) -> LoadResult:
        async with self._lock:
            if self.loaded is not None:
                await self._unload_locked()
            result, loaded = await asyncio.to_thread(self._load_blocking, req)
            self.loaded = loaded
            return result

    def _load_blocking(self, req: LoadRequest) -> tuple[LoadResult, LoadedModel]:
        t0 = time.perf_counter()
        dtype = DTYPES[req.dtype] if req.dtype else default_dtype(self.device)
        manifest = self.cache.manifest(req.snapshot_uri)  # one small read: is it still current?
        key = HostKey(manifest.digest, str(dtype).removeprefix("torch."))
        held = self.host_cache.take(key, self.device)
        t1 = time.perf_counter()
        pinned = held is None
        if held is not None:
            model, tokenizer, tier = held.model, held.tokenizer, "host"
            phases = {"fetch": t1 - t0, "load": 0.0}
        else:
            # Pinned while loaded: the LRU eviction never deletes files a model was read from.
            snap = self.cache.fetch(req.snapshot_uri, pin=True)
            manifest, key = snap.manifest, replace(key, digest=snap.manifest.digest)
            t1 = time.perf_counter()
        try:
            if held is None:
                model = load_model(snap.path, self.device, dtype)
                tokenizer = TextTokenizer(snap.path)
                tier = "disk" if snap.cache_hit else "remote"
                phases = {"fetch": t1 - t0, "load": time.perf_counter() - t1}
            t2 = time.perf_counter()
            # The salt keeps prefix-cache hits within one deployment's snapshot.
            config = replace(self.engine_config, prefix_cache_salt=manifest.digest.encode())
            engine = LLMEngine(model, self.device, config)
            _warm_up(engine)
            phases["warmup"] = time.perf_counter() - t2
        except BaseException:
            if pinned:
                self.cache.unpin(manifest.digest)
            raise
        loaded = LoadedModel(
            req.deployment, manifest.digest, tokenizer, AsyncEngine(engine), model, key, pinned
        )
        result = LoadResult(req.deployment, manifest.digest, tier != "remote", phases, tier)
        return result, loaded

    async def unload(self) -> None:
        async with self._lock:
            await self._unload_locked()

    async def _unload_locked(self) -> None:
        if self.loaded is not None:
            loaded, self.loaded = self.loaded, None
            await asyncio.to_thread(loaded.engine.shutdown)
            if loaded.pinned:
                self.cache.unpin(loaded.digest)
            # Keep the weights in RAM (within budget): loading them again costs nothing.
            await asyncio.to_thread(
                self.host_cache.put, loaded.host_key, loaded.model, loaded.tokenizer
            )

    def abort(self, request_id: str) -> bool:
        return self.loaded is not None and self.loaded.engine.abort(request_id)

    def prepare(self, req: GenerateRequest) -> tuple[LoadedModel, EngineRequest]:
        """Tokenize; raises ``NotLoaded`` / ``TemplateError`` before anything is streamed."""
        loaded = self.loaded
        if loaded is None:
            raise NotLoaded("no model is loaded on this worker")
        tok = loaded.tokenizer
        text = (
            tok.apply_chat_template(req.messages) if req.messages is not None else req.prompt or ""
        )
        ids = tuple(tok.encode(text))
        return loaded, EngineRequest(req.request_id, ids, req.params, tok.eos_token_ids)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """Stream text deltas; the last event has ``finish_reason`` and exact ``usage``."""
        loaded, ereq = self.prepare(req)
        detok = IncrementalDetokenizer(loaded.tokenizer, req.params.stop)
        n_prompt, n_out = len(ereq.prompt_token_ids), 0
        try:
            async for out in loaded.engine.generate(ereq):
                if out.finish_reason == "error":
                    text = detok.flush()
                    usage = Usage(n_prompt, n_out, out.num_cached_tokens)
                    yield GenerateEvent(text, (), "error", usage, out.error)
                    return
                n_out += len(out.new_token_ids)
                text = detok.push(out.new_token_ids)
                reason = "stop" if detok.stopped else out.finish_reason
                if reason is not None:
                    text += detok.flush()
                    usage = Usage(n_prompt, n_out, out.num_cached_tokens)
                    yield GenerateEvent(text, out.new_token_ids, reason, usage)
                    return  # leaving the engine's iterator aborts it if it was a stop string
                if text or out.new_token_ids:
                    # Running usage on every event: whoever cuts the stream knows what it cost.
                    yield GenerateEvent(text, out.new_token_ids, usage=Usage(n_prompt, n_out))
        except RequestRejected:
            raise  # before any token: the caller answers 400
        except Exception as exc:
            # The tokens already computed are still billable: report them with the error.
            yield GenerateEvent(finish_reason="error", usage=Usage(n_prompt, n_out), error=str(exc))


def _warm_up(engine: LLMEngine) -> None:
    # One real step through every layer so the first user request pays no lazy init.
    req = EngineRequest(
        "warmup", (1, 2, 3, 4), SamplingParams(max_tokens=2, temperature=0.0), frozenset()
    )
    engine.add_request(req)
    while engine.has_unfinished():
        engine.step()


__all__ = ["NotLoaded", "RequestRejected", "WorkerService", "pick_device"]
