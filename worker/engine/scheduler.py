"""One loop over a token budget per step (vLLM v1's idea, nano-vllm's size).

Running requests go first, in arrival order, each taking as many of its uncomputed tokens
as the budget allows (a decode needs one, a prefill chunk many); then waiting requests are
admitted FCFS while blocks, budget and ``max_num_seqs`` allow. When a running request
cannot get blocks, the latest arrival is preempted (blocks freed, recomputed later).
Speculative decoding adds to a decoding request's one token the proposals it carries
(``Request.spec_token_ids``): they take budget and KV slots like any token, the runner
verifies them in the same pass, and ``update_from_output`` keeps what was accepted and
gives the slots of the rest back (``KVCacheManager.free_tail``).
Torch-free: the scheduler sees tokens and block ids, never tensors.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from hotpool.worker.engine.kv_cache_manager import KVCacheBlocks, KVCacheManager
from hotpool.worker.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step
    num_new_tokens: int
    group_block_ids: tuple[tuple[int, ...], ...]  # the block table of each layer group
    # Proposed tokens verified in this step, after the request's last known token; they are
    # the last ``len(spec_token_ids)`` of ``num_new_tokens``.
    spec_token_ids: tuple[int, ...] = ()

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The first group's table (a one-group model's only one)."""
        return self.group_block_ids[0]

    @property
    def samples(self) -> bool:
        """This step computes the request's last known token, so it yields a new one."""
        num_known = self.num_new_tokens - len(self.spec_token_ids)
        return self.start + num_known == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept sorted by arrival
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Forget a request wherever it is and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request_id)
        request.status = RequestStatus.FINISHED
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            # Proposals ride only on a decode (the last known token is the one left), and
            # only as many as the budget leaves room for.
            spec = req.spec_token_ids
            if spec and req.num_tokens - req.num_computed_tokens == 1:
                spec = spec[: min(budget - 1, req.spec_room(self.config.max_model_len))]
                num_new += len(spec)
            else:
                spec = []
            while (
                self.kv.allocate_slots(
                    req.request_id, req.all_token_ids, req.num_computed_tokens, num_new
                )
                is None
            ):
                victim = self.running.pop()  # latest arrival: the list is in arrival order
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req itself was preempted; everyone after it already was
            scheduled.append(self._scheduled(req, num_new, spec))
            budget -= num_new
            i += 1
        # Admit waiting requests, FCFS, only if nothing had to be preempted this step.
        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            hit_blocks, num_hit = (KVCacheBlocks.empty(), 0)
            if req.num_computed_tokens == 0:
                hit_blocks, num_hit = self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
            num_new = min(req.num_tokens - num_hit, budget)
            new = self.kv.allocate_slots(
                req.request_id, req.all_token_ids, num_hit, num_new, hit_blocks
            )
            if new is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival)
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> dict[str, int]:
        """Advance what ran and append the tokens each request emitted (one, or with
        speculation the accepted proposals and one more); returns how many of those tokens
        each request keeps, for the requests that finished (a stop condition met midway
        drops the tokens after it). Finished requests leave the scheduler."""
        finished: dict[str, int] = {}
        for s in output.scheduled:
            req = s.request
            req.spec_token_ids = []
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted meanwhile
            k = len(s.spec_token_ids)
            tokens = sampled.get(req.request_id)
            if not tokens:
                req.num_computed_tokens = s.start + s.num_new_tokens - k
                if k:
                    self.kv.free_tail(req.request_id, req.num_tokens)
                continue
            # The KV is right for the last known token and the accepted proposals: every
            # emitted token but the last one (which the next step computes).
            req.num_computed_tokens = s.start + s.num_new_tokens - k + len(tokens) - 1
            for n, token in enumerate(tokens, 1):
                req.output_token_ids.append(token)
                reason = None
                if req.grammar is not None and not req.grammar.accept(token):
                    # The mask allows only what the grammar accepts: this is a fault upstream.
                    reason = "error"
                reason = reason or req.check_stop(token, self.config.max_model_len)
                if reason is not None:
                    req.finish_reason = reason
                    self._finish(req)
                    finished[req.request_id] = n
                    break
            else:
                if k:
                    # Slots written for rejected proposals go back (the next step writes the
                    # position of the last emitted token, so its block stays).
                    self.kv.free_tail(req.request_id, req.num_tokens)
        return finished

    def _scheduled(
        self, req: Request, num_new: int, spec: list[int] | None = None
    ) -> ScheduledRequest:
        return ScheduledRequest(
            req,
            req.num_computed_tokens,
            num_new,
            self.kv.get_group_block_ids(req.request_id),
            tuple(spec or ()),
        )

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the head of the queue, ahead of later arrivals (waiting stays in arrival order).
        idx = bisect.bisect(list(self.waiting), req.arrival, key=lambda r: r.arrival)
        self.waiting.insert(idx, req)

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        self.requests.pop(req.request_id, None)
        self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
