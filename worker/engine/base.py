"""The engine interface: what a replica's generation loop looks like from outside.

``add_request`` / ``abort`` / ``step``: each ``step`` advances every running request by the
work the engine schedules (a prefill chunk or one decoded token) and returns what changed.
The engine knows nothing of HTTP, text or SQL; token ids in, token ids out (the worker's
detokenizer makes text). :class:`~hotpool.worker.engine.llm_engine.LLMEngine` implements it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from hotpool.worker.engine.grammar import TokenGrammar
from hotpool.worker.protocol import FinishReason, SamplingParams

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a request too long
BASE_MODEL_CHAT = "model_not_chat"  # a chat request to a base model (no OpenAI code fits)


class RequestRejected(ValueError):
    """The request can never run on this engine (e.g. longer than the model's context).
    ``code`` is the OpenAI-style error code a client sees, if there is one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    # Structured output: the tokens this request may sample, step by step (None: any).
    grammar: TokenGrammar | None = None


@dataclass(frozen=True)
class SampledToken:
    """A sampled token with its logprob and, when asked for, the top-N alternatives."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class RequestOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    logprobs: tuple[SampledToken, ...] = ()  # one per new token when the request asked
    error: str | None = None  # why, when finish_reason is "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine(ABC):
    """Token-level generation over a loaded model. Not thread-safe: one thread drives it."""

    max_model_len: int

    @abstractmethod
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises :class:`RequestRejected` if it can never run."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop a request at any moment and free what it holds; unknown ids are ignored."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs for requests that progressed or finished."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def fail_all(self) -> list[str]:
        """After a step that raised: drop every request (their ids are returned) and every
        cached prefix, since blocks registered for that step's forward pass may hold
        garbage. The engine is then as after warm-up, less its prefix cache."""
