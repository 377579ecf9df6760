"""What a worker does, independent of HTTP: load a snapshot, generate, unload.

A worker holds at most one loaded deployment (it is then a replica of it). Loading is a
timed cold start: fetch the snapshot into the local cache (skipped on a hit), load weights,
warm up with one short forward pass. A model the worker unloads stays in host memory
(:class:`HostModelCache`, within a budget), so loading it again skips fetch and load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hotpool.kernels import cpu_ops, quant_ops
from hotpool.worker.capacity import CapacityMeter
from hotpool.worker.choices import Choices, engine_requests
from hotpool.worker.engine.async_engine import AsyncEngine
from hotpool.worker.engine.base import (
    BASE_MODEL_CHAT,
    CONTEXT_LENGTH_EXCEEDED,
    EngineRequest,
    RequestRejected,
)
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.engine.spec.draft import DraftModelProposer
from hotpool.worker.engine.spec.proposer import Proposer
from hotpool.worker.host_cache import HostKey, HostModelCache
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.models.loader import DTYPES, ModelLoadError, load_model
from hotpool.worker.models.packed_linear import cpu_has_native_bf16
from hotpool.worker.prefix_hash import deployment_salt
from hotpool.worker.prompt import fewest_tokens, parse_tools, prompt_bytes, prompt_token_ids
from hotpool.worker.protocol import (
    GenerateEvent,
    GenerateRequest,
    LoadRequest,
    LoadResult,
    SamplingParams,
    SpeculativeConfig,
)
from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.structured.compilers import grammar_compiler
from hotpool.worker.structured.grammar import GrammarCompiler, GrammarError
from hotpool.worker.structured.tools import ToolFormat, tool_constraint
from hotpool.worker.tokenizer import TextTokenizer

COMPILE_TIMEOUT_S = 10.0  # a structured-output constraint that compiles longer is a 400
TOKENIZE_INLINE_BYTES = 64 << 10  # longer prompts are tokenized off the event loop


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
    _grammars: Future[GrammarCompiler] | None = None
    kind: str | None = None  # the manifest's: ``base`` models refuse chat requests
    # Its engine's tokens/s by step size, from the steps after warm-up (the heartbeat's).
    capacity: CapacityMeter = field(default_factory=CapacityMeter)

    @property
    def grammars_built(self) -> bool:
        """Whether :meth:`grammars` answers without waiting."""
        return self._grammars is not None and self._grammars.done()

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer (blocking, while a
        build is under way: call it off the event loop). Loads build it before the replica
        is ready (:mod:`hotpool.worker.structured.compilers` says why)."""
        if self._grammars is None:
            self._grammars = grammar_compiler(self.tokenizer, self.model.config.vocab_size)
        return self._grammars.result()


def pick_device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def default_dtype(device: torch.device, quantization: str = "none") -> torch.dtype:
    """bf16 wherever it is fast: CUDA, and CPUs with native bf16 (PERF_NOTES: 5-15x fp32);
    fp32 on other CPUs, where torch emulates bf16 matmuls ~8x slower than fp32 (AVX2 EPYC).
    A quantized model's linears are hotpool's C kernels, which take bf16 activations on any
    CPU, as do its norms, RoPE and attention (cpu_ops): it computes in bf16 wherever those
    kernels build, and so records kernel programs (decode_graphs). Measured on an AVX2 EPYC
    (SmolLM2-135M int8, one stream): 10 ms a step in bf16, 30 in fp32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if quantization != "none" and cpu_ops.load() is not None and quant_ops.load() is not None:
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


class WorkerService:
    def __init__(
        self,
        cache: SnapshotCache,
        device: torch.device,
        engine_config: EngineConfig | None = None,
        host_cache: HostModelCache | None = None,
        settle_heap: Callable[[bool], object] | None = None,
    ) -> None:
        """``settle_heap`` (the worker process passes :func:`hotpool.heap.settle_heap`) runs
        once a model is in place, before the load is answered, with ``thaw=False``, and after
        an unload with ``thaw=True``: a model dropped from RAM is freed by the collector."""
        self.cache = cache
        self.device = device
        self.engine_config = engine_config or EngineConfig()
        self.host_cache = host_cache or HostModelCache(0)
        self.loaded: LoadedModel | None = None
        self._lock = asyncio.Lock()
        self._running: dict[str, tuple[str, ...]] = {}  # request id -> its choices' engine ids
        self._settle_heap = settle_heap

    async def load(self, req: LoadRequest) -> LoadResult:
        async with self._lock:
            if self.loaded is not None:
                await self._unload_locked()
            result, loaded = await asyncio.to_thread(self._load_blocking, req)
            self.loaded = loaded
            if self._settle_heap is not None:
                self._settle_heap(False)  # the model's objects out of the full passes
            return result

    def _load_blocking(self, req: LoadRequest) -> tuple[LoadResult, LoadedModel]:
        t0 = time.perf_counter()
        dtype = DTYPES[req.dtype] if req.dtype else default_dtype(self.device, req.quantization)
        manifest = self.cache.manifest(req.snapshot_uri)  # one small read: is it still current?
        key = HostKey(manifest.digest, str(dtype).removeprefix("torch."), req.quantization)
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
                model = load_model(snap.path, self.device, dtype, quantization=req.quantization)
                tokenizer = TextTokenizer(snap.path)
                tier = "disk" if snap.cache_hit else "remote"
                phases = {"fetch": t1 - t0, "load": time.perf_counter() - t1}
            t2 = time.perf_counter()
            # The salt keeps prefix-cache hits within one deployment's snapshot (the router
            # hashes prompts with the same salt to find this replica's prefixes).
            config = replace(
                self.engine_config,
                prefix_cache_salt=deployment_salt(manifest.digest, req.deployment),
                max_model_len=req.max_model_len or self.engine_config.max_model_len,
                kv_cache_bytes=req.kv_cache_bytes or self.engine_config.kv_cache_bytes,
            )
            # Built beside the engine's set-up and warm-up, and waited for below: it holds
            # the GIL, and a worker frozen by it after reporting ready serves nothing.
            grammars = grammar_compiler(tokenizer, model.config.vocab_size)
            spec, proposer = self._speculation(req, dtype, model, tokenizer, config)
            config = replace(config, speculative=spec)
            try:
                engine = LLMEngine(model, self.device, config, proposer)
            except (OverflowError, MemoryError, OSError, torch.OutOfMemoryError) as exc:
                # The KV cache this deployment asks for cannot be had here: the cold start
                # fails with that said (an unhandled error ended the worker process).
                raise ModelLoadError(
                    f"cannot allocate the KV cache ({config.kv_cache_bytes} bytes) on "
                    f"{self.device}: {exc}"
                ) from exc
            _warm_up(engine)
            wait_futures([grammars])  # a failed build is the structured request's error
            phases["warmup"] = time.perf_counter() - t2
        except BaseException:
            if pinned:
                self.cache.unpin(manifest.digest)
            raise
        loaded = LoadedModel(
            req.deployment, manifest.digest, tokenizer, AsyncEngine(engine), model, key, pinned,
            _grammars=grammars, kind=manifest.kind,
        )  # fmt: skip
        result = LoadResult(
            req.deployment, manifest.digest, tier != "remote", phases, tier,
            kv_block_size=engine.kv_manager.block_size, max_model_len=engine.max_model_len,
            max_token_bytes=tokenizer.max_token_bytes,
        )  # fmt: skip
        return result, loaded

    def _speculation(
        self,
        req: LoadRequest,
        dtype: torch.dtype,
        model: LlamaModel,
        tokenizer: TextTokenizer,
        config: EngineConfig,
    ) -> tuple[SpeculativeConfig | None, Proposer | None]:
        """The deployment's speculative decoding policy, and for a draft model its proposer
        (the draft fetched and loaded in the target's dtype, its KV cache a quarter of the
        target's budget)."""
        if req.speculative is None:
            return None, None
        try:
            spec = SpeculativeConfig.from_json(req.speculative)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        if spec.method != "draft":
            return spec, None
        assert spec.draft_snapshot is not None
        # Not pinned: the draft's weights are in memory once loaded.
        snap = self.cache.fetch(spec.draft_snapshot)
        draft = load_model(snap.path, self.device, dtype)
        probe = "The quick brown fox, 12 tokens: ßüé 漢字 <tag> def f(x):\n\treturn x"
        if TextTokenizer(snap.path).encode(probe) != tokenizer.encode(probe):
            raise ModelLoadError(
                f"the draft model at {spec.draft_snapshot} does not share the model's tokenizer "
                "(a test text tokenizes differently): its proposals would never be accepted"
            )
        try:
            proposer = DraftModelProposer(
                draft,
                self.device,
                kv_cache_bytes=max(config.kv_cache_bytes // 4, 1 << 20),
                max_num_seqs=config.max_num_seqs,
                target_vocab_size=model.config.vocab_size,
            )
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        _warm_up(proposer.engine)
        return spec, proposer

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
            del loaded
            if self._settle_heap is not None:
                self._settle_heap(True)  # what of a model dropped from RAM only gc frees

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its choices); each ends with ``finish_reason="abort"``."""
        loaded = self.loaded
        if loaded is None:
            return False
        ids = self._running.get(request_id, (request_id,))
        return any([loaded.engine.abort(i) for i in ids])

    def prepare(
        self, req: GenerateRequest, tools: list[dict[str, Any]] | None = None
    ) -> tuple[LoadedModel, list[EngineRequest]]:
        """Tokenize (with ``tools``, :func:`request_tools` of ``req``) and split into
        choices; raises ``NotLoaded``, ``TemplateError`` or ``RequestRejected`` before
        anything is streamed."""
        loaded = self.loaded
        if loaded is None:
            raise NotLoaded("no model is loaded on this worker")
        try:
            req.params.validate()  # `n` is checked here: each choice's engine request has n=1
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        if req.messages is not None and loaded.kind == "base":
            raise RequestRejected(
                f"deployment {loaded.deployment!r} serves a base model: it continues a prompt and "
                "does not follow a chat (its answers to one are not usable); send a `prompt` "
                "to /v1/completions, or deploy an instruct model for chat",
                BASE_MODEL_CHAT,
            )
        tok = loaded.tokenizer
        least = fewest_tokens(prompt_bytes(req), tok.max_token_bytes)
        limit = loaded.engine.engine.max_model_len
        if least >= limit:  # refused without the seconds that tokenizing megabytes takes
            raise RequestRejected(
                f"this model's maximum context length is {limit} tokens; the prompt "
                f"({prompt_bytes(req)} bytes) is at least {least} tokens",
                CONTEXT_LENGTH_EXCEEDED,
            )
        ids = prompt_token_ids(tok, req, tools)
        return loaded, engine_requests(req.request_id, ids, req.params, tok.eos_token_ids)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """Stream text deltas of each choice (tagged with its ``index``); each choice's last
        event has its ``finish_reason``, and the stream's last one the exact ``usage``."""
        tools = request_tools(req)  # parsed once: rendering, the constraint, the parser
        if prompt_bytes(req) > TOKENIZE_INLINE_BYTES:
            # A long prompt is tokenized in a thread (the tokenizer lets go of the GIL): on
            # the event loop, a megabyte held every other stream of this replica for ~0.4 s.
            loaded, ereqs = await asyncio.to_thread(self.prepare, req, tools)
        else:
            loaded, ereqs = self.prepare(req, tools)
        tok = loaded.tokenizer
        constraint = request_constraint(req, tok.tool_format, tools)
        if constraint is not None:
            ereqs = await _constrained(loaded, ereqs, constraint)
        choices = Choices(tok, ereqs, req.params.stop, tok.tool_format if tools else None)
        engine = loaded.engine
        self._running[req.request_id] = tuple(e.request_id for e in ereqs)
        try:
            async with aclosing(engine.generate_many(ereqs)) as outs:
                async for out in outs:
                    event = choices.event(out)
                    if event is None:
                        continue
                    yield event
                    if event.finish_reason == "error" or choices.done:
                        return  # closing the engine's iterator aborts whatever still runs
                    if event.finish_reason is not None and not out.finished:
                        engine.abort(out.request_id)  # a stop string ended this choice early
        except RequestRejected:
            raise  # before any token: the caller answers 400
        except Exception as exc:
            # The tokens already computed are still billable: report them with the error.
            yield GenerateEvent(finish_reason="error", usage=choices.usage(), error=str(exc))
        finally:
            self._running.pop(req.request_id, None)


def request_tools(req: GenerateRequest) -> list[dict[str, Any]] | None:
    """The tools a chat request lets the model call (OpenAI's tool dicts); None without
    tools or with ``tool_choice`` "none" (then the tools are not even rendered, as vLLM)."""
    try:
        return parse_tools(req)
    except ValueError as exc:
        raise RequestRejected(str(exc)) from None


def request_constraint(
    req: GenerateRequest,
    fmt: ToolFormat = "hermes",
    tools: list[dict[str, Any]] | None = None,
) -> str | None:
    """The grammar constraint of a request, or None: with ``tool_choice`` "required" or a
    function's name, the tool call(s) in the model's call format ``fmt``; else its
    ``response_format``. A call that must happen wins over a response format: the two
    cannot both hold, and the call is what the client asked the model to do. ``tools``:
    :func:`request_tools` of ``req``, when the caller has it already."""
    tools = tools if tools is not None else request_tools(req)
    if tools is not None and req.tool_choice not in ("auto", "none"):
        return tool_constraint(tools, req.tool_choice, req.parallel_tool_calls, fmt)
    return req.params.response_format


async def _constrained(
    loaded: LoadedModel, ereqs: list[EngineRequest], constraint: str
) -> list[EngineRequest]:
    """Each choice with its own matcher of ``constraint``, compiled (or found in the cache)
    off the event loop, within :data:`COMPILE_TIMEOUT_S`; a 400 otherwise."""

    compiler = await asyncio.to_thread(loaded.grammars)  # once per model: not timed

    def matchers() -> list[EngineRequest]:
        return [replace(e, grammar=compiler.matcher(constraint)) for e in ereqs]

    try:
        return await asyncio.wait_for(asyncio.to_thread(matchers), COMPILE_TIMEOUT_S)
    except GrammarError as exc:
        raise RequestRejected(str(exc)) from None
    except TimeoutError:
        # The compile goes on in its thread (llguidance's fuel limits bound it); the request
        # is refused now, and a later one with the same schema finds it compiled.
        raise RequestRejected(
            f"the response format took longer than {COMPILE_TIMEOUT_S:g} s to compile; "
            "simplify the schema"
        ) from None


def _warm_up(engine: LLMEngine) -> None:
    # One real step through every layer so the first user request pays no lazy init.
    req = EngineRequest(
        "warmup", (1, 2, 3, 4), SamplingParams(max_tokens=2, temperature=0.0), frozenset()
    )
    engine.add_request(req)
    while engine.has_unfinished():
        engine.step()
    engine.capture_decode_graphs()  # on CUDA: in the warm-up phase of the cold start


__all__ = ["NotLoaded", "RequestRejected", "WorkerService", "pick_device"]
