"""Gather a finished generation's interleaved events into its choices, for the non-streaming
responses of the OpenAI routes and the native invoke API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hotpool.platform.errors import APIError
from hotpool.worker.protocol import GenerateEvent, PositionLogprobs, Usage


@dataclass
class Choice:
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None

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
        c.finish_reason = event.finish_reason or c.finish_reason
        usage = event.usage or usage
        event = await anext(events, None)
    return Collected(choices, usage)
