"""Messages that cross the worker's internal HTTP boundary.

This is the one module of ``hotpool.worker`` that the control plane (``platform``, ``pool``)
may import: plain dataclasses with JSON round trips, no torch. ``/generate`` answers with
newline-delimited JSON, one :class:`GenerateEvent` per line; the last one carries ``usage``
and ``finish_reason``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; ``temperature == 0`` is greedy."""

    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SamplingParams:
        return cls(**{**data, "stop": tuple(data.get("stop") or ())})


@dataclass(frozen=True)
class GenerateRequest:
    """One generation. Exactly one of ``prompt`` and ``messages`` is set; the worker owns
    tokenization (and the chat template), so the token counts it reports are billable truth."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateRequest:
        messages = data.get("messages")
        return cls(
            request_id=str(data["request_id"]),
            params=SamplingParams.from_json(data.get("params") or {}),
            prompt=data.get("prompt"),
            messages=None if messages is None else tuple(ChatMessage(**m) for m in messages),
        )


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerateEvent:
    """A text delta; on the final event ``finish_reason`` and ``usage`` are set."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateEvent:
        usage = data.get("usage")
        return cls(
            text=data.get("text", ""),
            token_ids=tuple(data.get("token_ids") or ()),
            finish_reason=data.get("finish_reason"),
            usage=None if usage is None else Usage(**usage),
            error=data.get("error"),
        )


@dataclass(frozen=True)
class LoadRequest:
    deployment: str
    snapshot_uri: str
    dtype: str | None = None  # None: the snapshot's own dtype

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LoadResult:
    """What a cold start did; ``phases`` are seconds per phase (fetch, load, warmup)."""

    deployment: str
    digest: str
    cache_hit: bool
    phases: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoadResult:
        return cls(**data)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the control plane when it registers and heartbeats."""

    worker_id: str
    address: str  # base URL of the worker's internal API, e.g. http://127.0.0.1:41234
    pid: int
    device: str
    memory_bytes: int
    loaded: str | None = None  # deployment whose snapshot is loaded, if any

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerInfo:
        return cls(**data)
