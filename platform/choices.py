"""Gather a finished generation's interleaved events into its choices, for the non-streaming
responses of the OpenAI routes and the native invoke API."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from hotpool.platform.errors import APIError
from hotpool.worker.protocol import GenerateEvent, PositionLogprobs, Usage


@dataclass
class Choice:
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    # OpenAI's message.tool_calls: [{id, type, function: {name, arguments}}], in call order
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass(frozen=True)
class Collected:
    choices: list[Choice]  # in index order
    usage: Usage


async def collect_choices(
    n: int, first: GenerateEvent, events: AsyncIterator[GenerateEvent]
) -> Collected:
    """Every event of a generation of ``n`` choices; a worker error mid-way is a 502."""
    choices = [Choice() for _ in range(n)]
    usage = Usage()
    event: GenerateEvent | None = first
    while event is not None:
        if event.finish_reason == "error":
            raise APIError(502, f"generation failed: {event.error}", type="api_error")
        if not 0 <= event.index < n:
            raise APIError(502, f"the worker sent choice {event.index} of {n}", type="api_error")
        c = choices[event.index]
        c.parts.append(event.text)
        c.token_ids.extend(event.token_ids)
        c.logprobs.extend(event.logprobs)
        if event.tool_calls:
            merge_tool_calls(c.tool_calls, event.tool_calls)
        c.finish_reason = event.finish_reason or c.finish_reason
        usage = event.usage or usage
        event = await anext(events, None)
    return Collected(choices, usage)


def merge_tool_calls(calls: list[dict[str, Any]], pieces: Iterable[dict[str, Any]]) -> None:
    """Add streamed ``delta.tool_calls`` pieces to ``calls``: a piece with an ``id`` starts
    a call, the others add to the ``arguments`` of the call at their ``index``."""
    for piece in pieces:
        function = piece.get("function") or {}
        if "id" in piece:
            calls.append(
                {
                    "id": piece["id"],
                    "type": piece.get("type", "function"),
                    "function": {
                        "name": function.get("name", ""),
                        "arguments": function.get("arguments", ""),
                    },
                }
            )
        elif 0 <= piece.get("index", -1) < len(calls):
            calls[piece["index"]]["function"]["arguments"] += function.get("arguments", "")
