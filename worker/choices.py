"""The ``n`` choices of one generation: engine outputs in, :class:`GenerateEvent` out.

A request for ``n`` choices runs as ``n`` engine sequences of the same prompt (ids
``{request_id}#{i}``; with a seed, choice ``i`` draws from ``seed + i``, so the choices
differ and still repeat). Each choice has its own detokenizer and stop strings. Usage counts
the prompt once and adds up the choices' completion tokens, as OpenAI and vLLM bill it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from hotpool.worker.detokenizer import IncrementalDetokenizer
from hotpool.worker.engine.base import EngineRequest, RequestOutput, SampledToken
from hotpool.worker.protocol import (
    FinishReason,
    GenerateEvent,
    PositionLogprobs,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from hotpool.worker.structured.tool_parser import Piece, ToolCallParser
from hotpool.worker.structured.tools import ToolFormat
from hotpool.worker.tokenizer import TextTokenizer

MIN_LOGPROB = -9999.0  # what OpenAI reports for a token the model rules out; JSON has no -inf


def engine_requests(
    request_id: str,
    prompt_token_ids: tuple[int, ...],
    params: SamplingParams,
    eos_token_ids: frozenset[int],
) -> list[EngineRequest]:
    """One engine request per choice; a single choice keeps the request's own id."""
    if params.n == 1:
        return [EngineRequest(request_id, prompt_token_ids, params, eos_token_ids)]
    return [
        EngineRequest(
            f"{request_id}#{i}",
            prompt_token_ids,
            replace(params, n=1, seed=None if params.seed is None else params.seed + i),
            eos_token_ids,
        )
        for i in range(params.n)
    ]


@dataclass
class _Choice:
    index: int
    detok: IncrementalDetokenizer
    num_tokens: int = 0
    num_cached: int | None = None  # prompt tokens this sequence found in the prefix cache
    done: bool = False
    # Tokens whose text is still held back (it may begin a stop string), each with the end
    # of its text and its logprobs: a token goes out with its text, as OpenAI's chunks pair
    # a delta's content with its tokens' logprobs.
    held: list[tuple[int, int, PositionLogprobs | None]] = field(default_factory=list)
    unsent: str = ""  # text the detokenizer released that waits for the rest of its token
    sent_chars: int = 0
    tools: ToolCallParser | None = None  # reads tool calls out of the released text


class Choices:
    """The state of a request's choices; :meth:`event` turns each engine output into the
    event to send (or ``None``), and :attr:`done` says when every choice has finished.

    With ``tool_format`` (a request with tools the model may call), each choice's text goes
    through a :class:`ToolCallParser`: calls leave the content and travel as the event's
    ``tool_calls`` pieces, while its tokens and logprobs travel as they would (all billed),
    and a choice that called a tool and stopped finishes with ``"tool_calls"``."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        requests: Sequence[EngineRequest],
        stop: Sequence[str],
        tool_format: ToolFormat | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.num_prompt = len(requests[0].prompt_token_ids)
        self.want_logprobs = requests[0].params.logprobs is not None
        self._by_id = {
            r.request_id: _Choice(
                i,
                IncrementalDetokenizer(tokenizer, stop, r.params.min_tokens),
                tools=None if tool_format is None else ToolCallParser(tool_format),
            )
            for i, r in enumerate(requests)
        }

    @property
    def done(self) -> bool:
        return all(c.done for c in self._by_id.values())

    def usage(self) -> Usage:
        # The other choices hit the blocks the first one computes: the prompt's own cache
        # hit is the smallest of theirs.
        cached = [c.num_cached for c in self._by_id.values() if c.num_cached is not None]
        return Usage(
            self.num_prompt,
            sum(c.num_tokens for c in self._by_id.values()),
            min(cached, default=0),
        )

    def event(self, out: RequestOutput) -> GenerateEvent | None:
        """The event for one output; a finish event ends its choice (by a stop string even
        while its engine sequence still runs: the caller aborts that one)."""
        c = self._by_id[out.request_id]
        if c.done:
            return None  # ended by a stop string; what its sequence did since is not sent
        if c.num_cached is None and out.finish_reason != "abort":
            c.num_cached = out.num_cached_tokens
        if out.finish_reason == "error":
            c.done = True
            c.unsent += c.detok.flush()
            held = replace(out, new_token_ids=(), logprobs=())  # an error brings no token
            text, token_ids, logprobs = self._release(c, held, last=True)  # what was held
            text, calls = _parse(c, text, last=True)
            return GenerateEvent(
                text, token_ids, "error", self.usage(), out.error, index=c.index,
                logprobs=logprobs, tool_calls=calls,
            )  # fmt: skip
        c.num_tokens += len(out.new_token_ids)
        c.unsent += c.detok.push(out.new_token_ids)
        reason: FinishReason | None = "stop" if c.detok.stopped else out.finish_reason
        if reason is not None:
            c.unsent += c.detok.flush()
        text, token_ids, logprobs = self._release(c, out, last=reason is not None)
        text, calls = _parse(c, text, last=reason is not None)
        if reason is not None:
            c.done = True
            if reason == "stop" and c.tools is not None and c.tools.calls:
                reason = "tool_calls"
            return GenerateEvent(
                text, token_ids, reason, self.usage(), index=c.index, logprobs=logprobs,
                tool_calls=calls,
            )  # fmt: skip
        if not (text or out.new_token_ids or calls):
            return None
        # Running usage on every event (held tokens counted): whoever cuts the stream knows
        # what it cost.
        return GenerateEvent(
            text, token_ids, usage=self.usage(), index=c.index, logprobs=logprobs,
            tool_calls=calls,
        )  # fmt: skip

    def _release(
        self, c: _Choice, out: RequestOutput, last: bool
    ) -> tuple[str, tuple[int, ...], tuple[PositionLogprobs, ...]]:
        """What this event sends: the text of whole tokens the detokenizer has released,
        with those tokens and their logprobs; with a choice's last event, all that is left (a
        stop string's own tokens included, so that a choice's events carry every token
        billed). Text that may begin a stop string is held back, and a token whose text is
        partly held waits whole, so an event's tokens spell its text (as a chunk of OpenAI's
        stream pairs its content with the logprobs of its tokens)."""
        end = c.detok.decoded_chars
        lps = (
            self._logprobs(out.logprobs) if self.want_logprobs else [None] * len(out.new_token_ids)
        )
        c.held += [(end, t, lp) for t, lp in zip(out.new_token_ids, lps, strict=True)]
        if last:
            ready, text = len(c.held), c.unsent
        else:
            released, ready = c.detok.released_chars, 0
            while ready < len(c.held) and c.held[ready][0] <= released:
                ready += 1
            upto = c.held[ready - 1][0] if ready else c.sent_chars
            text = c.unsent[: upto - c.sent_chars]
        c.unsent = c.unsent[len(text) :]
        c.sent_chars += len(text)
        token_ids = tuple(t for _, t, _ in c.held[:ready])
        logprobs = tuple(lp for _, _, lp in c.held[:ready] if lp is not None)
        del c.held[:ready]
        return text, token_ids, logprobs

    def _logprobs(self, sampled: Sequence[SampledToken]) -> tuple[PositionLogprobs, ...]:
        return tuple(
            PositionLogprobs(
                self._token(s.token_id, s.logprob),
                tuple(self._token(t, lp) for t, lp in s.top_logprobs),
            )
            for s in sampled
        )

    def _token(self, token_id: int, logprob: float) -> TokenLogprob:
        text, utf8 = self.tokenizer.token_piece(token_id)
        value = logprob if math.isfinite(logprob) else MIN_LOGPROB
        return TokenLogprob(token_id, text, max(value, MIN_LOGPROB), utf8)


def _parse(c: _Choice, text: str, last: bool) -> tuple[str, tuple[Piece, ...]]:
    """A choice's released text as (content, tool call pieces); unchanged without tools."""
    if c.tools is None:
        return text, ()
    content, pieces = c.tools.push(text)
    if last:
        rest, more = c.tools.flush()
        content, pieces = content + rest, pieces + more
    return content, tuple(pieces)
