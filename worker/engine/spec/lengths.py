"""How many tokens to propose for each request, from how its proposals fared.

A proposal that is rejected is a position the step computed for nothing; on a CPU it costs
a good part of a token's own time (``benchmarks/bench_spec.py`` prints ms per step with and
without). A request whose output does not copy its prompt (a summary in the model's own
words) keeps getting spurious n-gram matches, so a fixed ``k`` makes it slower than
without speculation. The rule here, per request, after each verification:

- all ``a`` proposals accepted: propose ``min(k_max, a + 2)`` next time (grow quickly
  while the text is being copied);
- ``m < a`` accepted: propose ``m + 1`` next time (about what the last try sustained);
- none accepted: as above, and, unless a position more costs little (``pauses``, below),
  also stop proposing for a while, twice as long after each fully rejected try in a row
  (1, 2, 4, ... up to ``MAX_PAUSE`` steps); one accepted token ends the pauses.

Where a position more costs little (the engine clears ``pauses``: CUDA graphs, or kernel
programs whose measured ``row_cost`` is at most ``CHEAP_ROW``), nobody pauses. SmolLM2-135M
bf16 on 2 cores, replayed: a step of 1 row 12.8 ms, of 2 rows 13.7, of 6 rows 16.7. A
request that stopped copying still has 10-20% of its one-token guesses accepted, more than
the ~7% of a step each costs, so it keeps guessing: bench_spec summarize 1.24x -> 1.28x,
code 1.11x -> 1.26x without pauses. Its GGUF Q4_1 on an AVX2 path costs far more a row
(a verifying step of ~4.4 tokens 16.3 ms against 6.5 plain): without pauses summarize and
code fell to 0.96x and 0.95x there, so pauses stay.

It changes only how much is proposed: whatever it proposes, verification keeps the
output the target model's (greedy: the same tokens). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE = 16  # steps: a request that stops copying is retried at least this often
# A row's cost (share of a one-row step) up to which rejected requests need not pause: below
# the 10-20% of one-token guesses still accepted after a miss.
CHEAP_ROW = 0.1


@dataclass
class _State:
    length: int
    misses: int = 0  # fully rejected tries in a row
    pause: int = 0  # steps left without proposals


class ProposalLengths:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.pauses = True  # whether fully rejected requests pause (see the module)
        self._states: dict[str, _State] = {}

    def next(self, request_id: str) -> int:
        """Tokens to propose for the request this step (0: none; a paused step counts)."""
        state = self._states.get(request_id)
        if state is None:
            return self.max_tokens
        if state.pause > 0:
            state.pause -= 1
            return 0
        return state.length

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification's outcome: ``accepted`` of ``proposed`` tokens kept."""
        if proposed <= 0:
            return
        state = self._states.setdefault(request_id, _State(self.max_tokens))
        if accepted >= proposed:
            state.length = min(self.max_tokens, proposed + 2)
            state.misses = 0
        elif accepted > 0:
            state.length = accepted + 1
            state.misses = 0
        else:
            state.length = 1
            state.pause = min(MAX_PAUSE, 1 << state.misses) if self.pauses else 0
            state.misses += 1

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
