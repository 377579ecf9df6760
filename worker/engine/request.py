"""A request as the engine tracks it: counted in tokens.

``num_computed_tokens`` catches up with ``num_tokens`` (prompt + output). A prefill chunk,
a decode step and a prefix-cache hit are all just advances of that counter, so the
scheduler needs no phases. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from hotpool.worker.engine.grammar import TokenGrammar
from hotpool.worker.protocol import FinishReason, SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits again and recomputes
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival: int  # engine-wide sequence number: FCFS order, and who is preempted first
    max_new_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit of the first admission; -1 until then
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    grammar: TokenGrammar | None = None  # fed every sampled token (the scheduler does)
    # Proposed next tokens (speculative decoding) the next step verifies; they are not
    # tokens of the request until verification accepts them, and are cleared every step.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    def spec_room(self, max_model_len: int) -> int:
        """How many proposals the next step may verify: a step emits the accepted ones and
        one more, so they stop short of ``max_new_tokens``, and their positions of the
        model's context."""
        left = self.max_new_tokens - len(self.output_token_ids) - 1
        return max(0, min(left, max_model_len - self.num_tokens))

    def check_stop(self, token: int, max_model_len: int) -> FinishReason | None:
        """Why the request ends after sampling ``token``, if it does."""
        p = self.params
        n_out = len(self.output_token_ids)
        if self.grammar is not None and self.grammar.is_terminated:
            return "stop"  # the grammar took its end: nothing more may follow
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                return "stop"
        if n_out >= self.max_new_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
