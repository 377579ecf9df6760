"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.billing.deployments import DeploymentSpec
from hotpool.platform.answer_bounds import answer_bounds_json
from hotpool.platform.auth import Principal, authorize, caller, owned
from hotpool.platform.choices import collect_choices
from hotpool.platform.errors import APIError
from hotpool.platform.invoke import Served, version_header
from hotpool.platform.logprobs import CompletionLogprobs, chat_logprobs
from hotpool.platform.schemas import CompletionCall, parse_chat, parse_completion
from hotpool.platform.services import Services, read_json
from hotpool.streaming import ChunkStream, DisconnectWatch, Last, while_connected
from hotpool.worker.protocol import GenerateEvent, PositionLogprobs, Usage

SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _finish(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else ("stop" if reason == "abort" else reason)


class _Shape:
    """The few differences between chat and text completions' response shapes."""

    def __init__(self, call: CompletionCall, request_id: str) -> None:
        self.chat = call.endpoint == "chat.completions"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id.removeprefix("req_")
        self.created = int(time.time())
        self.model = call.model
        self.object = "chat.completion" if self.chat else "text_completion"
        self.n = call.params.n
        self.want_logprobs = call.params.logprobs is not None
        self._legacy: dict[int, CompletionLogprobs] = {}  # per choice: text offsets run on

    def choice(
        self,
        index: int,
        text: str,
        finish: str | None,
        positions: Sequence[PositionLogprobs] = (),
        first: bool = False,
        final: bool = False,
        tool_calls: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        """One choice of a response (``final``) or of a chunk; ``first``: its first chunk.
        ``tool_calls``: the message's calls (``final``) or the chunk's pieces of them (at
        most one per call: :func:`_tool_call_deltas`); as OpenAI's, the content beside them
        is null when there is no text."""
        logprobs = self._logprobs(index, positions) if positions or final else None
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        content = None if tool_calls and not text else text
        if final:
            body: dict[str, Any] = {"role": "assistant", "content": content}
            if tool_calls:
                body["tool_calls"] = list(tool_calls)
            return {"index": index, "message": body, "logprobs": logprobs, "finish_reason": finish}
        if first:
            delta: dict[str, Any] = {"role": "assistant", "content": content}
        else:
            delta = {"content": text} if text else {}
        if tool_calls:
            delta["tool_calls"] = list(tool_calls)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, index: int, positions: Sequence[PositionLogprobs]) -> Any:
        if not self.want_logprobs:
            return None
        if self.chat:
            return chat_logprobs(positions)
        return self._legacy.setdefault(index, CompletionLogprobs()).chunk(positions)

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


async def chat_completions(request: Request) -> Response:
    principal = await authorize(request, "invoke")  # before reading the body
    return await _complete(request, principal, parse_chat(await read_json(request)))


async def completions(request: Request) -> Response:
    principal = await authorize(request, "invoke")
    return await _complete(request, principal, parse_completion(await read_json(request)))


async def _complete(request: Request, principal: Principal, call: CompletionCall) -> Response:
    services: Services = request.app.state.services
    await services.schemas.check(principal.tenant_id, call)
    spec = owned(services.catalog.get(call.model), principal)
    if spec is None:
        raise APIError(
            404, f"The model `{call.model}` does not exist or you do not have access to it.",
            param="model", code="model_not_found",
        )  # fmt: skip
    request_id: str = request.scope["state"]["request_id"]
    target = services.router.choose(spec, services.catalog.canary_of(spec), call.user)
    served = Served()
    events = services.invoker.generate(target, call, request_id, caller(request, principal), served)

    # The first event: queueing, cold start and validation errors surface before it.
    async def respond(first: GenerateEvent, watch: DisconnectWatch) -> Response:
        shape = _Shape(call, request_id)
        headers = version_header(served)
        if call.stream:
            stream = _sse(shape, call, first, events)
            return ChunkStream(stream, SSE_MEDIA_TYPE, headers, watch=watch)
        return JSONResponse(await _collect(shape, first, events), headers=headers)

    return await while_connected(request.receive, events, respond)


async def _collect(
    shape: _Shape, first: GenerateEvent, events: AsyncIterator[GenerateEvent]
) -> dict[str, Any]:
    choices = await collect_choices(shape.n, first, events)
    body = shape.envelope(
        [
            shape.choice(
                i, c.text, _finish(c.finish_reason), c.logprobs, final=True, tool_calls=c.tool_calls
            )
            for i, c in enumerate(choices.choices)
        ],
        chunk=False,
    )
    body["usage"] = usage_json(choices.usage)
    return body


async def _sse(
    shape: _Shape, call: CompletionCall, first: GenerateEvent, events: AsyncIterator[GenerateEvent]
) -> AsyncIterator[bytes]:
    """The SSE body: one chunk per worker event (one write); the stream ends with the event
    that finishes the last choice, before the worker's stream closes and the request is
    accounted for (both run after the client has everything)."""

    def data(obj: dict[str, Any]) -> str:
        if call.include_usage:
            obj.setdefault("usage", None)  # OpenAI: null on every chunk but the last
        return f"data: {json.dumps(obj)}\n\n"

    def chunk(choice: dict[str, Any]) -> str:
        return data(shape.envelope([choice], chunk=True))

    # Most chunks are one choice's text and nothing else: the envelope around it is the
    # same every time, so it is encoded once (json.dumps of the whole chunk cost ~8 us of
    # the control plane's ~100 us per token) and only the text is encoded per chunk.
    head, _, tail = data(shape.envelope([None], chunk=True)).rpartition('"choices": [null]')
    head += '"choices": ['
    tail = "]" + tail
    field = '"delta": {"content": ' if shape.chat else '"text": '
    close = (
        '}, "logprobs": null, "finish_reason": null}'
        if shape.chat
        else (', "logprobs": null, "finish_reason": null}')
    )

    def text_chunk(index: int, text: str) -> str:
        return f'{head}{{"index": {index}, {field}{json.dumps(text)}{close}{tail}'

    event: GenerateEvent | None = first
    started: set[int] = set()  # choices whose first chunk (with the role) is out
    finished: set[int] = set()
    usage = Usage()
    out: list[str] = []  # the current event's SSE text
    try:
        try:
            while event is not None:
                if event.usage is not None:
                    usage = event.usage
                if event.finish_reason == "error":
                    error = APIError(502, f"generation failed: {event.error}")
                    out.append(_error_event(data, error, usage))
                    break
                i = event.index
                plain = not (event.logprobs or event.tool_calls)
                if event.text and plain and (i in started or not shape.chat):
                    out.append(text_chunk(i, event.text))  # == chunk(shape.choice(...))
                    started.add(i)
                elif event.text or not plain or i not in started:
                    first, *more = _tool_call_deltas(event.tool_calls)
                    choice = shape.choice(
                        i, event.text, None, event.logprobs, i not in started, tool_calls=first
                    )
                    out.append(chunk(choice))
                    out.extend(chunk(shape.choice(i, "", None, tool_calls=d)) for d in more)
                    started.add(i)
                finish = _finish(event.finish_reason)
                if finish is not None:
                    out.append(chunk(shape.choice(i, "", finish)))
                    if 0 <= i < shape.n:
                        finished.add(i)
                    if len(finished) == shape.n:
                        break  # every choice is done: this event ends the response
                if out:
                    yield "".join(out).encode()
                    out.clear()
                event = await anext(events, None)
            if call.include_usage:
                final = shape.envelope([], chunk=True)
                final["usage"] = usage_json(usage)
                out.append(f"data: {json.dumps(final)}\n\n")
        except APIError as exc:  # the stream has started: report in band
            out.append(_error_event(data, exc, usage))
        out.append("data: [DONE]\n\n")
        yield Last("".join(out).encode())
        with contextlib.suppress(APIError):  # the client has it all; the worker's end, then
            async for _ in events:  # the invoker's accounting (nothing more is expected)
                pass
    finally:
        await events.aclose()


def _tool_call_deltas(pieces: Sequence[dict[str, Any]]) -> list[Sequence[dict[str, Any]]]:
    """An event's ``delta.tool_calls`` pieces, one chunk's worth each, in OpenAI's order:
    a call's header (``id``, ``type``, ``name``, empty ``arguments``) in a chunk of its
    own, then its arguments. A client that reads ``delta.tool_calls[0]`` of each chunk (or
    takes one entry per index) sees every piece; two of one call in a chunk hid the second.
    No pieces: one empty group, for the chunk of the event's text."""
    return [[p] for p in pieces] or [()]


def _error_event(data: Callable[[dict[str, Any]], str], error: APIError, usage: Usage) -> str:
    """A stream's in-band error, with the usage it is billed for (``partial``: the tokens
    computed before it, as the ledger keeps them), so a client can see what it paid."""
    return data({"error": error.body()["error"], "usage": usage_json(usage)})


def model_json(spec: DeploymentSpec) -> dict[str, Any]:
    created = int(spec.created_at.timestamp()) if spec.created_at else 0
    return {
        "id": spec.name,
        "object": "model",
        "created": created,
        "owned_by": "hotpool",
        "answers": answer_bounds_json(spec),  # hotpool's: how long an answer may be
    }


async def list_models(request: Request) -> Response:
    principal = await authorize(request, "invoke")
    services: Services = request.app.state.services
    mine = (s for s in services.catalog.all().values() if s.tenant_id == principal.tenant_id)
    specs = sorted(mine, key=lambda s: s.name)
    return JSONResponse({"object": "list", "data": [model_json(s) for s in specs]})


async def get_model(request: Request) -> Response:
    principal = await authorize(request, "invoke")
    services: Services = request.app.state.services
    spec = owned(services.catalog.get(request.path_params["model"]), principal)
    if spec is None:
        raise APIError(
            404,
            f"The model `{request.path_params['model']}` does not exist.",
            code="model_not_found",
        )
    return JSONResponse(model_json(spec))


# The invocations (POST): served past Starlette's routing (hotpool.platform.hot_routes).
invocations = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}

routes = [
    *(Route(path, handler, methods=["POST"]) for path, handler in invocations.items()),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]
