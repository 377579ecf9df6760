"""The engine: scheduler + KV cache manager + model runner, one ``step`` at a time.

``step()`` is three calls, as in nano-vllm: ``scheduler.schedule()`` ->
``runner.execute()`` -> ``scheduler.update_from_output()``; with speculative decoding a
proposer first guesses each decoding request's next tokens (``spec``), which the same
forward pass verifies.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hotpool.worker.engine.base import (
    CONTEXT_LENGTH_EXCEEDED,
    Engine,
    EngineRequest,
    RequestOutput,
    RequestRejected,
)
from hotpool.worker.engine.decode_graphs import (
    DecodeGraphs,
    cpu_batch_sizes,
    graph_batch_sizes,
    graphs_wanted,
)
from hotpool.worker.engine.kv_cache_manager import KVCacheManager
from hotpool.worker.engine.kv_groups import kv_cache_groups
from hotpool.worker.engine.model_runner import ModelRunner
from hotpool.worker.engine.request import Request
from hotpool.worker.engine.scheduler import Scheduler, SchedulerConfig
from hotpool.worker.engine.spec.lengths import CHEAP_ROW, ProposalLengths
from hotpool.worker.engine.spec.proposer import ProposalInput, Proposer
from hotpool.worker.engine.spec.switch import SpecSwitch
from hotpool.worker.models import kv_memory
from hotpool.worker.models.attention import PagedKVCache
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.protocol import SpeculativeConfig

_GRAMMAR_FAULT = "the sampled token is not one the request's grammar allows; generation stopped"

log = logging.getLogger("hotpool.engine")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # KV budget; the number of blocks follows from it
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's own
    enable_prefix_caching: bool = True
    prefix_cache_salt: bytes = b""  # per deployment: prefixes never match across deployments
    # Kernels (None: chosen by device and dtype); set to compare paths in tests and benchmarks.
    attention_backend: str | None = None  # "torch", "native" (C, bf16 on the CPU), "triton"
    sampler_backend: str | None = None  # "torch", "triton", "reference"
    speculative: SpeculativeConfig | None = None  # None: one token per request and step
    # Decode steps replayed as CUDA graphs, or on the CPU as kernel programs
    # (``decode_graphs``). None: for dense models on CUDA unless HOTPOOL_CUDA_GRAPHS=0, and
    # on the CPU for bf16 models on the native kernels unless HOTPOOL_CPU_PROGRAMS=0. True on
    # the CPU records programs where the model allows and else replays the static buffers
    # eagerly (what tests check the runner with).
    cuda_graphs: bool | None = None


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks held by requests
    num_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_steps: int
    last_step_seconds: float
    last_step_tokens: int
    spec_proposed: int = 0  # proposed tokens verified (speculative decoding)
    spec_accepted: int = 0  # of which the target accepted
    spec_enabled: bool = False  # the automatic switch's state (False without speculation)


class LLMEngine(Engine):
    def __init__(
        self,
        model: LlamaModel,
        device: torch.device,
        config: EngineConfig | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """``proposer``: what guesses tokens when ``config.speculative`` is set (None: the
        n-gram proposer its config names; a draft model's is built by the caller, which
        loads the draft's weights)."""
        self.config = config = config or EngineConfig()
        cfg = model.config
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        dtype = model.embed.weight.dtype
        # Layers that attend alike share a block table; a model mixing full and sliding
        # layers (Gemma 3) gets a group per kind, so that blocks behind the window are freed
        # from the sliding groups' tables while the full ones keep theirs (``kv_groups``).
        self.kv_groups = groups = kv_cache_groups(
            [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
        )
        per_block = PagedKVCache.bytes_per_block(
            groups.slots, config.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype
        )
        num_blocks = config.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} is less than one block ({per_block} bytes)"
            )
        auto = config.cuda_graphs is None
        graphs = graphs_wanted(device, model) if auto else bool(config.cuda_graphs)
        self.kv_cache = PagedKVCache(
            cfg.num_hidden_layers,
            num_blocks + (1 if graphs else 0),  # the graphs' scratch block, past the pool
            config.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
            device,
            layer_slots=groups.layer_slot,
        )
        self.kv_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.prefix_cache_salt,
            windows=groups.windows,
        )
        sched = SchedulerConfig(
            config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len
        )
        self.scheduler = Scheduler(sched, self.kv_manager)
        self.runner = ModelRunner(
            model,
            self.kv_cache,
            device,
            config.attention_backend,
            config.sampler_backend,
            groups.layer_group if groups.num_groups > 1 else (),
        )
        self.decode_graphs: DecodeGraphs | None = None
        if graphs:
            # On the CPU: kernel programs. Where the engine chose them itself, a model they
            # cannot record runs eagerly; asked for, the buffers replay eagerly (tests).
            cpu = device.type == "cpu"
            sizes = cpu_batch_sizes if cpu and auto else graph_batch_sizes
            self.decode_graphs = DecodeGraphs(
                model, self.kv_cache, self.runner.attention, self.runner.layer_group,
                self.runner.num_groups, self.max_model_len, scratch_block=num_blocks,
                sizes=sizes(_decode_rows(config)), capture=device.type == "cuda",
                programs=cpu, eager_replays=not auto,
            )  # fmt: skip
        self.spec = config.speculative
        self.proposer: Proposer | None = None
        self.spec_switch: SpecSwitch | None = None
        if self.spec is not None:
            self.proposer = proposer or _default_proposer(self.spec)
            self.spec_switch = SpecSwitch(self.spec.max_batch)
        # Per request, how many tokens to propose from how its last proposals fared.
        self.spec_lengths = ProposalLengths(self.spec.num_tokens if self.spec else 1)
        self._spec_counts = [0, 0]  # proposed, accepted
        self._arrivals = itertools.count()
        self._steps = 0
        self._last_step = (0.0, 0)
        # Called after every step with (seconds, batched tokens): the worker's metrics hook.
        self.on_step: Callable[[float, int], None] | None = None

    def capture_decode_graphs(self) -> float:
        """Capture the decode graphs (the cold start's warm-up calls it, after a first
        request has compiled the kernels), and a draft model's; the seconds it took, 0
        without graphs. Decode steps replay them from then on."""
        seconds = 0.0 if self.proposer is None else self.proposer.capture_decode_graphs()
        if self.decode_graphs is None:
            return seconds
        seconds += self.decode_graphs.capture()
        self.runner.graphs = self.decode_graphs
        return seconds

    def _cheap_rows(self) -> bool:
        """Whether a rejected proposal costs little (``spec.lengths``): CUDA graphs, or
        kernel programs measured at most ``CHEAP_ROW`` of a step a row."""
        graphs = self.runner.graphs
        if graphs is None or not graphs.replayed:
            return False
        if graphs.capture_graphs:
            return True
        cost = graphs.row_cost()
        return cost is not None and cost <= CHEAP_ROW

    def add_request(self, request: EngineRequest) -> None:
        n = len(request.prompt_token_ids)
        try:
            request.params.validate()
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        if n == 0:
            raise RequestRejected("the prompt is empty")
        want = request.params.max_tokens
        least = request.params.min_tokens  # <= max_tokens (validated): it binds without one
        if n + max(want or 1, least) > self.max_model_len:
            asks = (
                f"{want} more"
                if want
                else (f"at least {least} more (min_tokens)" if least > 1 else "1 more")
            )
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {n} prompt tokens and asks for {asks}",
                CONTEXT_LENGTH_EXCEEDED,
            )
        max_new = want or self.max_model_len - n
        # A sequence must fit the whole KV budget by itself, or it would preempt itself forever.
        # Under a sliding window it holds at most a window, a prefill chunk and 2 partial
        # blocks of it, in each sliding layer group.
        kv = self.kv_manager
        need = kv.blocks_held_at_most(n + max_new, self.config.max_num_batched_tokens)
        if need > kv.num_blocks:
            raise RequestRejected(
                f"the request needs up to {need} KV cache blocks of {kv.block_size} tokens "
                f"({n + max_new} tokens over {kv.num_groups} layer group(s)); this replica "
                f"holds {kv.num_blocks} (lower max_tokens)",
                CONTEXT_LENGTH_EXCEEDED,
            )
        if request.request_id in self.scheduler.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already running")
        self.scheduler.add_request(
            Request(
                request.request_id,
                tuple(request.prompt_token_ids),
                request.params,
                request.eos_token_ids,
                next(self._arrivals),
                max_new,
                grammar=request.grammar,
            )
        )

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        self.runner.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)
            self.spec_lengths.release(request_id)

    def _propose(self) -> None:
        """Guesses for each running request about to decode, unless the switch is off.
        Requests under a grammar are left out: each position's mask depends on the tokens
        accepted before it, which the verifier does not track."""
        assert self.proposer is not None and self.spec is not None and self.spec_switch
        decoding = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        if not self.spec_switch.update(len(decoding)):
            return
        ready = []
        for r in decoding:
            room = r.spec_room(self.max_model_len) if r.grammar is None else 0
            want = min(room, self.spec_lengths.next(r.request_id)) if room else 0
            if want:
                ready.append((r, want))
        if not ready:
            return
        guesses = self.proposer.propose(
            [ProposalInput(r.request_id, r.prompt_token_ids, r.output_token_ids) for r, _ in ready],
            max(want for _, want in ready),
        )
        for (r, want), guess in zip(ready, guesses, strict=True):
            r.spec_token_ids = list(guess[:want])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def fail_all(self) -> list[str]:
        ids = list(self.scheduler.requests)
        for request_id in ids:
            self.abort(request_id)
        # A full block is registered in the prefix cache when it is allocated, before the
        # pass that writes its KV (kv_cache_manager): after a failed pass it may hold
        # anything, and a later request with that prefix would be served it.
        if not self.kv_manager.reset_prefix_cache():
            log.error("the prefix cache could not be reset: blocks are still held")
        if self.proposer is not None:
            self.proposer.reset()
        return ids

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        # The forward passes (the draft model's too) keep the KV cache's background
        # population off the cores they run on (kv_memory).
        with kv_memory.foreground():
            if self.proposer is not None:
                self._propose()
            plan = self.scheduler.schedule()
            if plan.is_empty:
                return []
            result = self.runner.execute(plan)
        sampled = result.sampled
        outputs = []
        for request_id, why in result.failed.items():
            req = self.scheduler.abort(request_id)
            self._release(request_id)
            if req is not None:
                outputs.append(
                    RequestOutput(
                        request_id=request_id,
                        new_token_ids=(),
                        finish_reason="error",
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                        error=why,
                    )
                )
        if any(s.spec_token_ids for s in plan.scheduled):
            self.spec_lengths.pauses = not self._cheap_rows()
        for s in plan.scheduled:
            if s.spec_token_ids and s.request.request_id in sampled:
                accepted = len(sampled[s.request.request_id]) - 1
                self._spec_counts[0] += len(s.spec_token_ids)
                self._spec_counts[1] += accepted
                self.spec_lengths.observe(s.request.request_id, len(s.spec_token_ids), accepted)
        finished = self.scheduler.update_from_output(
            plan, {k: [t.token_id for t in v] for k, v in sampled.items()}
        )
        for s in plan.scheduled:
            req = s.request
            tokens = sampled.get(req.request_id)
            if tokens is None:
                continue  # a prefill chunk that did not reach the end of the prompt yet
            done = req.request_id in finished
            if done:
                tokens = tokens[: finished[req.request_id]]  # none after a stop
                self._release(req.request_id)
            outputs.append(
                RequestOutput(
                    request_id=req.request_id,
                    new_token_ids=tuple(t.token_id for t in tokens),
                    finish_reason=req.finish_reason if done else None,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    logprobs=tuple(tokens) if req.params.logprobs is not None else (),
                    error=_GRAMMAR_FAULT if req.finish_reason == "error" else None,
                )
            )
        self._steps += 1
        self._last_step = (time.perf_counter() - t0, plan.num_batched_tokens)
        if self.on_step is not None:
            self.on_step(*self._last_step)
        return outputs

    def stats(self) -> EngineStats:
        kv = self.kv_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=kv.usage,
            num_blocks=kv.num_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._steps,
            last_step_seconds=self._last_step[0],
            last_step_tokens=self._last_step[1],
            spec_proposed=self._spec_counts[0],
            spec_accepted=self._spec_counts[1],
            spec_enabled=self.spec_switch is not None and self.spec_switch.on,
        )


def _decode_rows(config: EngineConfig) -> int:
    """The most rows a decode step holds: one per request, and with speculation ``k + 1`` per
    verifying request (the model runner's spans), while the automatic switch lets at most
    ``max_batch`` of them speculate (every one with ``max_batch=0``)."""
    spec = config.speculative
    if spec is None:
        return config.max_num_seqs
    speculating = config.max_num_seqs if spec.max_batch == 0 else spec.max_batch
    return max(config.max_num_seqs, min(speculating, config.max_num_seqs) * (spec.num_tokens + 1))


def _default_proposer(spec: SpeculativeConfig) -> Proposer:
    if spec.method != "ngram":
        raise ValueError(f"speculative method {spec.method!r} needs its proposer passed in")
    from hotpool.worker.engine.spec.ngram import NgramProposer

    return NgramProposer(spec.ngram)
