"""The engine's view of a grammar: which tokens a request may sample next.

A request may carry a :class:`TokenGrammar` (structured output: a JSON schema, a tool
call). Each step the model runner asks every sampling request's grammar to fill its row of
a token bitmask (int32 ``[B, (V + 31) // 32]``, bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed), and the sampler treats disallowed tokens as ``-inf``; the scheduler
then feeds each sampled token to :meth:`TokenGrammar.accept`. A preempted request keeps its
output tokens, so its grammar's state stays right. The grammar engine itself lives outside
the engine (:mod:`hotpool.worker.structured`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class TokenGrammar(ABC):
    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar does not allow it."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """Nothing more may follow (the document closed, or an EOS ended it where it could
        go on): the request stops with this token."""

    @classmethod
    @abstractmethod
    def fill_bitmasks(cls, rows: Sequence[tuple[TokenGrammar, int]], bitmask: torch.Tensor) -> None:
        """Fill row ``i`` of ``bitmask`` with the next tokens each ``(grammar, i)`` allows, for
        the whole batch at once (an implementation may use threads)."""


def token_bitmask(rows: Sequence[tuple[TokenGrammar, int]], batch: int, vocab: int) -> torch.Tensor:
    """The step's bitmask: all ones (no constraint) except the rows of ``rows``."""
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    by_kind: dict[type[TokenGrammar], list[tuple[TokenGrammar, int]]] = {}
    for grammar, row in rows:
        by_kind.setdefault(type(grammar), []).append((grammar, row))
    for kind, group in by_kind.items():
        kind.fill_bitmasks(group, bitmask)
    return bitmask
