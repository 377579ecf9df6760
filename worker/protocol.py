"""Messages that cross the worker's internal HTTP boundary.

This is the one module of ``hotpool.worker`` that the control plane (``platform``, ``pool``)
may import: plain dataclasses with JSON round trips, no torch. ``/generate`` answers with
newline-delimited JSON, one :class:`GenerateEvent` per line; each choice's last event
carries its ``finish_reason``, and the stream's last event the request's exact ``usage``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import orjson

# "tool_calls": the choice ended after the model called tools (OpenAI's reason).
FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


# Model types (a snapshot manifest's ``architecture``, config.json's ``model_type``) that the
# worker's model code runs; the control plane checks deployments against it without torch.
# tests/worker/test_family_push_serve.py holds it to every family's pushed snapshot.
RUNNABLE_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma3_text",
)  # fmt: skip


def wire_dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON bytes, for the control plane <-> worker streams (every token
    crosses them): orjson, ~10x faster than ``json.dumps`` for a generate request. A string
    that orjson refuses (a lone surrogate, which no validated request holds but an error
    message might) falls back to ``json``, which escapes it."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":")).encode()


def wire_loads(data: bytes) -> Any:
    """The inverse of :func:`wire_dumps` (``ValueError`` for what is not JSON); the escape of
    a lone surrogate that orjson refuses is read by ``json``."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


MAX_N = 16  # choices one request may ask for
MAX_LOGPROBS = 20  # top alternatives per position


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system, user, assistant or tool
    content: str
    name: str | None = None  # the participant's name, given to the chat template as is
    # An assistant message's tool calls, as OpenAI's JSON list ([{id, type, function: {name,
    # arguments}}]) in compact JSON text: the wire stays flat. None: no tool calls.
    tool_calls: str | None = None
    tool_call_id: str | None = None  # a ``tool`` message: the call it answers


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; ``temperature == 0`` is greedy. :meth:`validate` says what is wrong."""

    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0  # EOS and stop tokens are ignored before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each sampled position (0: only the token's)
    n: int = 1  # choices for the prompt: the worker runs n sequences, one request
    # Structured output, compact JSON text (the wire stays flat): {"type": "json_object"} or
    # {"type": "json_schema", "schema": {...}, "strict": bool}; None: free text. The worker
    # compiles it into a grammar that masks the sampler's choices at every step.
    response_format: str | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first parameter out of range."""
        checks = [
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must not exceed max_tokens"),
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables it)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("n", 1 <= self.n <= MAX_N, f"must be in [1, {MAX_N}]"),
        ]  # fmt: skip
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"`{name}` {why}")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SamplingParams:
        return cls(
            **{
                **data,
                "stop": tuple(data.get("stop") or ()),
                "stop_token_ids": tuple(data.get("stop_token_ids") or ()),
            }
        )


_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class GenerateRequest:
    """One generation. Exactly one of ``prompt`` and ``messages`` is set; the worker owns
    tokenization (and the chat template), so the token counts it reports are billable truth."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    # OpenAI's ``tools`` (a list of function definitions) as compact JSON text, and
    # ``tool_choice``: "none", "auto", "required" or a function's name; chat only.
    tools: str | None = None
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True

    def to_json(self) -> dict[str, Any]:
        # By hand: dataclasses.asdict deep-copies every field and costs ~10x this, once per
        # request on the control plane's hot path. The params are flat (ints, floats,
        # strings and tuples of them), so a shallow dict of them is already JSON-ready.
        messages = self.messages
        return {
            "request_id": self.request_id,
            "params": {name: getattr(self.params, name) for name in _PARAM_FIELDS},
            "prompt": self.prompt,
            "messages": None if messages is None else [message_wire(m) for m in messages],
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateRequest:
        messages = data.get("messages")
        return cls(
            request_id=str(data["request_id"]),
            params=SamplingParams.from_json(data.get("params") or {}),
            prompt=data.get("prompt"),
            messages=None if messages is None else tuple(ChatMessage(**m) for m in messages),
            tools=data.get("tools"),
            tool_choice=data.get("tool_choice") or "auto",
            parallel_tool_calls=bool(data.get("parallel_tool_calls", True)),
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
class TokenLogprob:
    """A token's logprob. ``token`` is its text and ``utf8`` its exact bytes: a byte-level
    token can hold part of a character, which ``token`` then shows as U+FFFD."""

    token_id: int
    token: str
    logprob: float
    utf8: tuple[int, ...]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TokenLogprob:
        return cls(data["token_id"], data["token"], data["logprob"], tuple(data["utf8"]))

    def to_json(self) -> dict[str, Any]:
        return {
            "token_id": self.token_id,
            "token": self.token,
            "logprob": self.logprob,
            "utf8": list(self.utf8),
        }


@dataclass(frozen=True)
class PositionLogprobs:
    """One output position: the sampled token and the ``logprobs`` best tokens, best first."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PositionLogprobs:
        return cls(
            TokenLogprob.from_json(data["sampled"]),
            tuple(TokenLogprob.from_json(t) for t in data.get("top") or ()),
        )

    def to_json(self) -> dict[str, Any]:
        return {"sampled": self.sampled.to_json(), "top": [t.to_json() for t in self.top]}


@dataclass(frozen=True)
class GenerateEvent:
    """A text delta of choice ``index``; the choice's last event has its ``finish_reason``.

    With ``n`` choices the stream interleaves them and ends after the last choice's finish
    (or the first ``"error"``, which ends them all). ``usage`` is the running total of the
    whole request (the prompt once, completion tokens summed over choices), so the stream's
    last event carries the exact one. ``logprobs`` holds one entry per token in
    ``token_ids`` when the request asked for them.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    index: int = 0
    logprobs: tuple[PositionLogprobs, ...] = ()
    # Pieces of tool calls parsed from the choice's output, as OpenAI's streamed
    # ``delta.tool_calls`` entries: {"index", "id", "type", "function": {"name",
    # "arguments"}} on a call's first piece, {"index", "function": {"arguments"}} after.
    tool_calls: tuple[dict[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        # By hand, as GenerateRequest's: one of these per token on the worker.
        u = self.usage
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "usage": None
            if u is None
            else {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "cached_tokens": u.cached_tokens,
            },
            "error": self.error,
            "index": self.index,
            "logprobs": [p.to_json() for p in self.logprobs],
            "tool_calls": list(self.tool_calls),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateEvent:
        # Decoded per token per stream on the control plane: built without the frozen
        # dataclass's __init__ (an object.__setattr__ per field: 3.5 us of the 8 us this
        # took), with the same fields, equality and hash. Every field must be set here.
        usage = data.get("usage")
        logprobs = data.get("logprobs")
        event = _new(cls)
        event.__dict__.update(
            text=data.get("text", ""),
            token_ids=tuple(data.get("token_ids") or ()),
            finish_reason=data.get("finish_reason"),
            usage=None if usage is None else Usage(**usage),
            error=data.get("error"),
            index=data.get("index", 0),
            logprobs=tuple(map(PositionLogprobs.from_json, logprobs)) if logprobs else (),
            tool_calls=tuple(data.get("tool_calls") or ()),
        )
        return event


_new = object.__new__


# A deployment's speculative decoding policy, as the control plane validates it and the
# load request carries it (``LoadRequest.speculative``); the engine's proposers and its
# automatic switch (``hotpool.worker.engine.spec``) run it.
@dataclass(frozen=True)
class NgramConfig:
    """The n-gram lengths tried, longest first."""

    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if self.min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {self.min_n}")
        if self.max_n < self.min_n:
            raise ValueError(f"max_n must be >= min_n ({self.min_n}), got {self.max_n}")


SpecMethod = Literal["ngram", "draft"]
SPEC_METHODS: tuple[SpecMethod, ...] = ("ngram", "draft")
MAX_SPEC_TOKENS = 16  # k beyond this verifies mostly rejected positions
# Speculation is on while at most this many requests decode in a step. Measured with
# benchmarks/bench_spec.py on SmolLM2 (fp32, 2 AVX2 cores): n-gram speculation at k = 4 wins
# at 1-4 decoding sequences and loses from 8 on, where a step's cost grows with its tokens.
DEFAULT_MAX_BATCH = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod = "ngram"
    num_tokens: int = 4  # k: tokens proposed per request and step
    # The automatic switch: off while more than ``max_batch`` requests decode in a step, on
    # again once at most ``max_batch // 2`` do (a gap, so a batch size on the edge does not
    # flip it every step). 0 keeps it on at every batch size.
    max_batch: int = DEFAULT_MAX_BATCH
    ngram: NgramConfig = field(default_factory=NgramConfig)
    draft_snapshot: str | None = None  # method "draft": the draft model's snapshot URI

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            known = ", ".join(SPEC_METHODS)
            raise ValueError(f"method must be one of {known}, got {self.method!r}")
        if not 1 <= self.num_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_tokens must be in [1, {MAX_SPEC_TOKENS}], got {self.num_tokens}")
        if self.max_batch < 0:
            raise ValueError(f"max_batch must be >= 0, got {self.max_batch}")
        if (self.method == "draft") != (self.draft_snapshot is not None):
            raise ValueError(
                "draft_snapshot is required with method 'draft'"
                if self.method == "draft"
                else "draft_snapshot goes only with method 'draft'"
            )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "num_tokens": self.num_tokens,
            "max_batch": self.max_batch,
        }
        if self.method == "ngram":
            out["ngram"] = {"min_n": self.ngram.min_n, "max_n": self.ngram.max_n}
        if self.draft_snapshot is not None:
            out["draft_snapshot"] = self.draft_snapshot
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """The config from its JSON form; ValueError naming the field that is wrong."""
        if not isinstance(data, dict):
            raise ValueError("speculative must be an object")
        known = {"method", "num_tokens", "max_batch", "ngram", "draft_snapshot"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown field(s) in speculative: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        for name in ("num_tokens", "max_batch"):
            if name in data and (type(data[name]) is not int):
                raise ValueError(f"speculative.{name} must be an integer")
        for name in ("method", "draft_snapshot"):
            if data.get(name) is not None and not isinstance(data[name], str):
                raise ValueError(f"speculative.{name} must be a string")
        ngram = data.get("ngram") or {}
        if not isinstance(ngram, dict) or set(ngram) - {"min_n", "max_n"}:
            raise ValueError("speculative.ngram must be an object with min_n and/or max_n")
        if any(type(v) is not int for v in ngram.values()):
            raise ValueError("speculative.ngram.min_n and max_n must be integers")
        try:
            return cls(
                method=data.get("method", "ngram"),
                num_tokens=data.get("num_tokens", 4),
                max_batch=data.get("max_batch", DEFAULT_MAX_BATCH),
                ngram=NgramConfig(**ngram),
                draft_snapshot=data.get("draft_snapshot"),
            )
        except ValueError as exc:
            raise ValueError(f"speculative: {exc}") from None


@dataclass(frozen=True)
class LoadRequest:
    deployment: str
    snapshot_uri: str
    dtype: str | None = None  # None: the snapshot's own dtype
    max_model_len: int | None = None  # None: the worker's setting (default: the model's)
    kv_cache_bytes: int | None = None  # None: the worker's HOTPOOL_KV_CACHE_BYTES
    quantization: str = "none"  # none, int8 (made at load) or gguf (the snapshot's blocks)
    # The speculative decoding policy (``SpeculativeConfig``'s JSON), None for none.
    speculative: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LoadResult:
    """What a cold start did; ``phases`` are seconds per phase (fetch, load, warmup).

    ``tier`` is where the weights came from: ``remote`` (the object store), ``disk`` (the
    worker's snapshot cache) or ``host`` (still in RAM from an earlier unload).
    """

    deployment: str
    digest: str
    cache_hit: bool
    phases: dict[str, float] = field(default_factory=dict)
    tier: str = "remote"
    kv_block_size: int | None = None  # the engine's, for the router's prompt hashes
    # The engine's context length, and the most bytes of text a token stands for: the
    # router refuses a prompt whose bytes alone prove it longer, before it is admitted.
    max_model_len: int | None = None
    max_token_bytes: int | None = None

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
    # Fraction of the loaded engine's KV cache blocks in use; None with no model loaded
    # (and from workers older than the field, whose payloads still parse).
    kv_cache_usage: float | None = None
    # Speculative decoding since the model loaded: tokens proposed and accepted, and whether
    # the automatic switch has it on now; None without speculation (or from older workers).
    spec_proposed: int | None = None
    spec_accepted: int | None = None
    spec_enabled: bool | None = None
    # The loaded engine's prefix cache since the last heartbeat, for cache-aware routing:
    # hashes (worker/prefix_hash.py's ``reported``) cached and evicted, and whether to
    # forget all before (a fresh engine, a reset, a lost heartbeat). The control plane
    # keeps them in its router's index, never in what it shows of the worker.
    kv_block_size: int | None = None
    prefix_stored: list[str] | None = None
    prefix_removed: list[str] | None = None
    prefix_reset: bool = False
    # The loaded engine's measured tokens/s by step size (worker/capacity.py: tokens in a
    # step, a power of two, as text -> tokens/s), for token-aware scaling and planning.
    capacity: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerInfo:
        info = cls(**data)
        _check_prefix_report(info)
        usage = info.kv_cache_usage
        # It ends up in a Prometheus gauge: a string would fail every scrape, not this call.
        if usage is not None and (isinstance(usage, bool) or not isinstance(usage, int | float)):
            raise TypeError(f"kv_cache_usage must be a number, not {type(usage).__name__}")
        for name in ("spec_proposed", "spec_accepted"):
            value = getattr(info, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an integer, not {type(value).__name__}")
        if info.spec_enabled is not None and not isinstance(info.spec_enabled, bool):
            raise TypeError("spec_enabled must be a boolean")
        return info


def _check_prefix_report(info: WorkerInfo) -> None:
    for name in ("prefix_stored", "prefix_removed"):
        value = getattr(info, name)
        if value is not None and (
            not isinstance(value, list)
            or not all(isinstance(h, str) and len(h) == 16 for h in value)
        ):
            raise TypeError(f"{name} must be a list of 16-character hashes")
    if not isinstance(info.prefix_reset, bool):
        raise TypeError("prefix_reset must be a boolean")
    curve = info.capacity
    if curve is not None and (
        not isinstance(curve, dict)
        or len(curve) > 32
        or not all(
            isinstance(k, str) and k.isdigit() and isinstance(v, int | float)
            and not isinstance(v, bool) and v > 0
            for k, v in curve.items()
        )
    ):  # fmt: skip
        raise TypeError("capacity must map step sizes to positive tokens/s")
    size = info.kv_block_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        raise TypeError("kv_block_size must be a positive integer")


def message_wire(m: ChatMessage) -> dict[str, Any]:
    """A message on the wire to the worker: every field that is set."""
    out = message_json(m)
    if m.tool_calls is not None:
        out["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def message_json(m: ChatMessage) -> dict[str, str]:
    """An OpenAI message dict: on the wire to the worker, and what chat templates render.
    ``name`` only when given: templates test ``'name' in message`` (or ``message.name is
    defined``), as HF's apply_chat_template passes the OpenAI message dict through."""
    out = {"role": m.role, "content": m.content}
    if m.name is not None:
        out["name"] = m.name
    return out
