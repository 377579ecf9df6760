"""Parse and validate OpenAI-compatible request bodies into typed calls.

Every problem is an :class:`APIError` 400 naming the parameter. Parameters hotpool does not
support yet are rejected, never silently ignored: a client that asks for ``logit_bias`` must
not get something else without knowing. :func:`sampling_params` is shared with the native
invoke API; tools are checked in :mod:`hotpool.platform.tools`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from hotpool.platform.errors import invalid
from hotpool.platform.response_format import parse_response_format
from hotpool.platform.tools import parse_call_id, parse_tool_calls, parse_tools
from hotpool.worker.protocol import MAX_LOGPROBS, MAX_N, ChatMessage, SamplingParams

Endpoint = Literal["chat.completions", "completions", "invoke"]

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
MAX_USER = 256  # characters of the `user` end-user id, as OpenAI allows
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' `logprobs`, as OpenAI allows
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1  # int64, as OpenAI; torch takes no wider seed
MAX_NAME = 256  # characters of a message's `name`
# What OpenAI's own assistant messages carry besides role, content and tool calls: a client
# that sends a response's message back (``message.model_dump()``) sends them, null or empty.
# Null or empty they say nothing and pass; with a value they are refused like any other field.
_EMPTY_MESSAGE_FIELDS = {"refusal", "annotations", "audio", "function_call"}
_MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}

_SAMPLING = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",  # vLLM's extensions
}  # fmt: skip
CHAT_FIELDS = _SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                           "tool_choice", "parallel_tool_calls", "response_format"}  # fmt: skip
COMPLETION_FIELDS = _SAMPLING | {"prompt", "echo", "suffix", "best_of"}
# OpenAI's other chat parameters, which hotpool does not support: refused with a value, but
# passed when null (SDKs built on the openai client send optional fields as null, and null
# asks for nothing). A field OpenAI does not know is refused even when null: likely a typo.
CHAT_NULLABLE = frozenset({
    "store", "metadata", "modalities", "audio", "prediction", "service_tier",
    "reasoning_effort", "functions", "function_call", "web_search_options", "verbosity",
    "safety_identifier", "prompt_cache_key",
})  # fmt: skip


@dataclass(frozen=True)
class CompletionCall:
    """A validated ``/v1/chat/completions``, ``/v1/completions`` or native invoke request;
    ``params.n`` choices, ``params.logprobs`` top alternatives per token (None: no logprobs)."""

    endpoint: Endpoint
    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    user: str | None = None
    # Chat's tools (compact JSON text of the checked list; None: none), and tool_choice:
    # "none", "auto", "required" or a function's name (hotpool.platform.tools).
    tools: str | None = None
    tool_choice: str = "none"
    parallel_tool_calls: bool = True


def parse_chat(body: Any) -> CompletionCall:
    b = Body(body, CHAT_FIELDS, CHAT_NULLABLE)
    messages = parse_messages(b)
    # Both are validated: a bad `max_tokens` beside a good `max_completion_tokens` is still
    # a mistake to report, and two different limits leave no way to know which was meant.
    new, old = b.opt_int("max_completion_tokens", 1), b.opt_int("max_tokens", 1)
    if new is not None and old is not None and new != old:
        raise invalid(
            f"`max_completion_tokens` ({new}) and `max_tokens` ({old}) disagree: give one "
            "(`max_tokens` is the older name of `max_completion_tokens`)",
            "max_tokens",
        )
    max_tokens = new if new is not None else old
    tools = parse_tools(*(b.body.get(k) for k in ("tools", "tool_choice", "parallel_tool_calls")))
    logprobs = b.opt("logprobs", bool, False)
    top = b.opt_int("top_logprobs", 0)
    if top is not None and top > MAX_LOGPROBS:
        raise invalid(f"`top_logprobs` must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
    if top is not None and not logprobs:
        raise invalid("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
    num_logprobs = (top or 0) if logprobs else None
    call = _call(b, "chat.completions", max_tokens, num_logprobs, messages=messages)
    return replace(
        call, tools=tools.tools, tool_choice=tools.choice, parallel_tool_calls=tools.parallel
    )


def parse_completion(body: Any) -> CompletionCall:
    b = Body(body, COMPLETION_FIELDS)
    prompt = b.require("prompt", (str, list))
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise invalid(
                "`prompt` must be a string (batches and token arrays are not supported yet)",
                "prompt",
            )
        prompt = prompt[0]
    if prompt == "":
        raise invalid("`prompt` must not be empty", "prompt")
    # None: OpenAI's 16, or the deployment's default_max_tokens (hotpool.platform.answer_bounds)
    max_tokens = b.opt_int("max_tokens", 1)
    b.unsupported_unless("echo", lambda v: v in (None, False))
    b.unsupported_unless("suffix", lambda v: v is None)
    b.unsupported_unless("best_of", lambda v: v is None or _number_is(v, 1))
    logprobs = b.opt_int("logprobs", 0)
    if logprobs is not None and logprobs > MAX_LEGACY_LOGPROBS:
        raise invalid(f"`logprobs` must be between 0 and {MAX_LEGACY_LOGPROBS}", "logprobs")
    return _call(b, "completions", max_tokens, logprobs, prompt=prompt)


def parse_messages(b: Body) -> tuple[ChatMessage, ...]:
    """``messages``: at least one, each with a known role and text content (an assistant's
    may be null beside its ``tool_calls``; a ``tool`` message names its ``tool_call_id``)."""
    messages = tuple(_message(m, i) for i, m in enumerate(b.require("messages", list)))
    if not messages:
        raise invalid("`messages` must hold at least one message", "messages")
    return messages


def _call(
    b: Body,
    endpoint: Endpoint,
    max_tokens: int | None,
    logprobs: int | None,
    messages: tuple[ChatMessage, ...] | None = None,
    prompt: str | None = None,
) -> CompletionCall:
    model = b.require("model", str)
    stream = bool(b.opt("stream", bool, False))
    options = b.opt("stream_options", dict, None)
    if options is not None and not stream:
        raise invalid("`stream_options` is only allowed when `stream` is true", "stream_options")
    include_usage = False
    if options:
        unknown = set(options) - {"include_usage"}
        if unknown:
            raise invalid(f"unknown stream_options: {', '.join(sorted(unknown))}", "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise invalid("`stream_options.include_usage` must be a boolean", "stream_options")
    b.opt("logit_bias", dict, None)
    b.unsupported_unless("logit_bias", lambda v: not v)
    user = b.opt("user", str, None)
    if user is not None and len(user) > MAX_USER:
        raise invalid(f"`user` must be at most {MAX_USER} characters", "user")
    params = sampling_params(b, max_tokens, logprobs)
    return CompletionCall(endpoint, model, params, stream, include_usage, messages, prompt, user)


def sampling_params(b: Body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The sampling fields every endpoint shares (OpenAI's, vLLM's extensions, ``n``),
    checked against the engine's own rules, so nothing the engine would refuse gets past."""
    n = b.opt_int("n", 1, default=1) or 1
    if n > MAX_N:
        raise invalid(f"`n` must be between 1 and {MAX_N}", "n")
    temperature = b.opt_number("temperature", 0.0, 2.0, 1.0)
    top_p = b.opt_number("top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise invalid("`top_p` must be greater than 0", "top_p")
    top_k = b.opt_int("top_k", -1, default=0)
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=b.opt_int("min_tokens", 0, default=0) or 0,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k or 0, 0),
        min_p=b.opt_number("min_p", 0.0, 1.0, 0.0),
        presence_penalty=b.opt_number("presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=b.opt_number("frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=b.opt_number("repetition_penalty", 0.0, 10.0, 1.0),
        seed=_seed(b),
        stop=_stop(b.opt("stop", (str, list), None)),
        ignore_eos=bool(b.opt("ignore_eos", bool, False)),
        logprobs=logprobs,
        n=n,
        response_format=parse_response_format(b.body.get("response_format")),
    )
    try:
        params.validate()
    except ValueError as exc:
        param = str(exc).split("`")[1] if "`" in str(exc) else None
        raise invalid(str(exc), param) from None
    return params


def _seed(b: Body) -> int | None:
    seed = b.opt_int("seed", None)
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED:
        raise invalid("`seed` must be a 64-bit signed integer", "seed")
    return seed


def _stop(value: str | list[Any] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if len(items) > MAX_STOP or not all(isinstance(s, str) and s for s in items):
        raise invalid(
            f"`stop` must be a non-empty string or a list of up to {MAX_STOP} of them", "stop"
        )
    return tuple(items)


def _message(raw: Any, i: int) -> ChatMessage:
    param = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise invalid(f"`{param}` must be an object with `role` and `content`", param)
    unknown = {
        k
        for k, v in raw.items()
        if k not in _MESSAGE_FIELDS and not (k in _EMPTY_MESSAGE_FIELDS and (v is None or v == []))
    }
    if unknown:
        raise invalid(f"`{param}` has unsupported fields: {', '.join(sorted(unknown))}", param)
    role = raw.get("role")
    if role not in ROLES:
        raise invalid(f"`{param}.role` must be one of {', '.join(ROLES)}", f"{param}.role")
    if role != "assistant" and raw.get("tool_calls") not in (None, []):
        raise invalid("only assistant messages carry `tool_calls`", f"{param}.tool_calls")
    calls = parse_tool_calls(raw.get("tool_calls"), f"{param}.tool_calls")
    call_id = None
    if role == "tool":
        call_id = parse_call_id(raw.get("tool_call_id"), f"{param}.tool_call_id")
    elif raw.get("tool_call_id") is not None:
        raise invalid("only tool messages carry a `tool_call_id`", f"{param}.tool_call_id")
    content = raw.get("content")
    if content is None and calls is not None:
        content = ""  # an assistant turn of tool calls only
    if isinstance(content, list):  # content parts: text only for now
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"`{param}.content` parts must be text parts", f"{param}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(f"`{param}.content` must be a string", f"{param}.content")
    name = raw.get("name")
    if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME):
        raise invalid(
            f"`{param}.name` must be a string of 1 to {MAX_NAME} characters", f"{param}.name"
        )
    role = "system" if role == "developer" else role
    return ChatMessage(role, content, name, tool_calls=calls, tool_call_id=call_id)


class Body:
    """A JSON object being validated: typed getters that raise a 400 naming the field."""

    def __init__(
        self, body: Any, allowed: set[str], nullable: frozenset[str] = frozenset()
    ) -> None:
        """``nullable``: fields refused unless null (then they are as good as absent)."""
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        unknown = sorted(
            k for k, v in body.items() if k not in allowed and (k not in nullable or v is not None)
        )
        if unknown:
            raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
        self.body = body

    def require(self, name: str, types: type | tuple[type, ...]) -> Any:
        if self.body.get(name) is None:
            raise invalid(f"`{name}` is required", name)
        return self.opt(name, types, None)

    def opt(self, name: str, types: type | tuple[type, ...], default: Any) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            raise invalid(f"`{name}` has the wrong type ({type(value).__name__})", name)
        return value

    def opt_int(self, name: str, minimum: int | None, default: int | None = None) -> int | None:
        value = self.opt(name, int, default)
        if value is not None and minimum is not None and value < minimum:
            raise invalid(f"`{name}` must be >= {minimum}", name)
        return value

    def opt_number(self, name: str, lo: float, hi: float, default: float) -> float:
        try:
            value = float(self.opt(name, (int, float), default))
        except OverflowError:  # an integer too large for a float: out of range
            value = math.inf
        if not lo <= value <= hi:
            raise invalid(f"`{name}` must be between {lo:g} and {hi:g}", name)
        return value

    def unsupported_unless(self, name: str, ok: Callable[[Any], bool], why: str = "") -> None:
        if not ok(self.body.get(name)):
            raise invalid(
                why or f"`{name}` is not supported yet by hotpool", name, "unsupported_parameter"
            )


def _number_is(value: Any, target: float) -> bool:
    # bool is an int in Python: `n: true` must not pass for `n: 1`.
    return isinstance(value, int | float) and not isinstance(value, bool) and value == target


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)
