"""What a proposer is: something that guesses each request's next few tokens, cheaply.

A guess is only a hint. The target model scores every proposed token in the step that
verifies them (``hotpool.worker.engine.spec.rejection``), which keeps the output's
distribution exactly the target's whatever was proposed: a bad proposer costs speed,
never correctness. Torch-free, like the scheduler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ProposalInput:
    """One request's tokens so far: prompt then output, as two sequences so the engine can
    hand over its live lists (``Request.prompt_token_ids``, ``Request.output_token_ids``)
    without concatenating them every step. A caller with one list passes it as the prompt.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token(self, i: int) -> int:
        """Token ``i`` of prompt + output (0 <= i < num_tokens)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens_from(self, start: int) -> list[int]:
        """Tokens ``[start, num_tokens)`` of prompt + output, without building the rest."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return list(self.output_token_ids[start - n :])
        return [*self.prompt_token_ids[start:], *self.output_token_ids]


class Proposer(ABC):
    """Guesses up to ``k`` next tokens per request.

    The contract:

    - ``propose`` returns one list per input, in the inputs' order, each of at most ``k``
      token ids (fewer, or none, when the proposer has no good guess); ``k == 0`` gives
      empty lists. The guesses for a request are its tokens ``num_tokens``,
      ``num_tokens + 1``, ... in order.
    - A proposer may keep state per request id (an index of its tokens, a draft model's KV
      cache). Between two ``release`` calls a request's tokens only grow: a step appends
      the tokens it accepted, never rewrites earlier ones (a preempted request keeps its
      tokens). ``release`` drops the state of a finished or aborted request; releasing an
      unknown id does nothing.
    - It never raises for a request it cannot help; it proposes nothing for it.
    """

    @abstractmethod
    def propose(self, requests: Sequence[ProposalInput], k: int) -> list[list[int]]:
        """Up to ``k`` guessed next tokens for each request."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Forget the request's state."""

    def reset(self) -> None:  # noqa: B027 (optional: per-request state goes by release)
        """Forget everything (the target's step failed, in this proposer or after it); the
        target has released every request already."""

    def capture_decode_graphs(self) -> float:
        """Capture whatever the proposer replays (a draft model's decode graphs or kernel
        programs), when the target's engine captures its own; the seconds it took."""
        return 0.0
