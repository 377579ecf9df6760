"""The native invoke API: ``POST /v1/deployments/{name}/invoke``.

Body: exactly one of ``prompt`` (a string) and ``messages`` (chat messages, as in OpenAI's
chat API), an optional ``params`` object of sampling parameters (``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``stop``, ``seed``, the penalties,
``min_tokens``, ``ignore_eos``, ``n``, ``logprobs``: top alternatives per token, 0-20,
``response_format``: as OpenAI's chat API, text, json_object or json_schema) and
``stream``. ``max_tokens`` defaults as in the OpenAI routes: the deployment's
``default_max_tokens``, else 16 for a prompt and up to the context length for messages.

The answer holds each choice's text and token ids; streamed, it is newline-delimited JSON:
``{"index", "text", "token_ids"}`` per delta, then ``{"usage", "finish_reasons"}``. With
``logprobs`` set, outputs and deltas also carry ``logprobs``, one entry per token.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotpool.platform.auth import authorize, caller, owned
from hotpool.platform.choices import Collected, collect_choices
from hotpool.platform.errors import APIError, invalid
from hotpool.platform.invoke import Served, version_header
from hotpool.platform.logprobs import native_logprobs
from hotpool.platform.openai_routes import usage_json
from hotpool.platform.schemas import Body, CompletionCall, parse_messages, sampling_params
from hotpool.platform.services import Services, read_json
from hotpool.streaming import ChunkStream, DisconnectWatch, Last, while_connected
from hotpool.worker.protocol import GenerateEvent, Usage

INVOKE_FIELDS = {"prompt", "messages", "params", "stream"}
PARAM_FIELDS = {
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "n", "logprobs",
    "response_format",
}  # fmt: skip


def parse_invoke(body: Any, deployment: str) -> CompletionCall:
    """A validated invoke body; a parameter's 400 names it as ``params.<name>``."""
    b = Body(body, INVOKE_FIELDS)
    has_prompt, has_messages = (b.body.get(k) is not None for k in ("prompt", "messages"))
    if has_prompt == has_messages:
        param = "messages" if has_prompt else "prompt"
        raise invalid("give exactly one of `prompt` and `messages`", param)
    messages = parse_messages(b) if has_messages else None
    prompt = b.opt("prompt", str, None)
    if prompt == "":
        raise invalid("`prompt` must not be empty", "prompt")
    stream = bool(b.opt("stream", bool, False))
    raw = b.opt("params", dict, {})
    try:
        p = Body(raw, PARAM_FIELDS)
        max_tokens = p.opt_int("max_tokens", 1)  # None: hotpool.platform.answer_bounds's
        params = sampling_params(p, max_tokens, p.opt_int("logprobs", 0))
    except APIError as exc:
        if exc.param is None:
            raise
        name = f"params.{exc.param}"
        message = exc.message.replace(f"`{exc.param}`", f"`{name}`")
        raise APIError(exc.status, message, param=name, code=exc.code, type=exc.type) from None
    return CompletionCall("invoke", deployment, params, stream, False, messages, prompt)


async def invoke(request: Request) -> Response:
    principal = await authorize(request, "invoke")
    services: Services = request.app.state.services
    name: str = request.path_params["name"]
    call = parse_invoke(await read_json(request), name)
    await services.schemas.check(principal.tenant_id, call, prefix="params.")
    spec = owned(services.catalog.get(name), principal)
    if spec is None:
        raise APIError(404, f"deployment {name!r} does not exist", code="deployment_not_found")
    request_id: str = request.scope["state"]["request_id"]
    target = services.router.choose(spec, services.catalog.canary_of(spec), call.user)
    served = Served()
    events = services.invoker.generate(target, call, request_id, caller(request, principal), served)
    want_logprobs = call.params.logprobs is not None

    # The first event: queueing, cold start and validation errors surface before it.
    async def respond(first: GenerateEvent, watch: DisconnectWatch) -> Response:
        headers = version_header(served)
        if call.stream:
            lines = _ndjson(call.params.n, want_logprobs, first, events)
            return ChunkStream(lines, "application/x-ndjson", headers, watch=watch)
        collected = await collect_choices(call.params.n, first, events)
        return JSONResponse(
            _invocation(request_id, name, want_logprobs, collected), headers=headers
        )

    return await while_connected(request.receive, events, respond)


def _invocation(
    request_id: str, name: str, want_logprobs: bool, collected: Collected
) -> dict[str, Any]:
    outputs = []
    for i, c in enumerate(collected.choices):
        out: dict[str, Any] = {
            "index": i,
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
        }
        if want_logprobs:
            out["logprobs"] = native_logprobs(c.logprobs)
        outputs.append(out)
    return {
        "object": "invocation",
        "id": request_id,
        "deployment": name,
        "outputs": outputs,
        "usage": usage_json(collected.usage),
    }


async def _ndjson(
    n: int, want_logprobs: bool, first: GenerateEvent, events: AsyncIterator[GenerateEvent]
) -> AsyncIterator[bytes]:
    """One line per event with text; the usage line ends the response as soon as every
    choice has finished (the worker's end of stream and the accounting run after it)."""

    def line(obj: dict[str, Any]) -> bytes:
        return (json.dumps(obj) + "\n").encode()

    event: GenerateEvent | None = first
    usage = Usage()
    finishes: list[str | None] = [None] * n
    try:
        try:
            while event is not None:
                usage = event.usage or usage
                if event.finish_reason == "error":
                    error = APIError(502, f"generation failed: {event.error}", type="api_error")
                    yield Last(line(error.body()))
                    return
                if event.text or event.token_ids:
                    delta: dict[str, Any] = {
                        "index": event.index,
                        "text": event.text,
                        "token_ids": list(event.token_ids),
                    }
                    if want_logprobs:
                        delta["logprobs"] = native_logprobs(event.logprobs)
                    yield line(delta)
                if event.finish_reason is not None and 0 <= event.index < n:
                    finishes[event.index] = event.finish_reason
                    if None not in finishes:
                        break  # every choice is done: the usage line ends the response
                event = await anext(events, None)
        except APIError as exc:  # the stream has started: report in band
            yield Last(line({"error": exc.body()["error"]}))
            return
        yield Last(line({"usage": usage_json(usage), "finish_reasons": finishes}))
        with contextlib.suppress(APIError):  # the client has it all; the worker's end, then
            async for _ in events:  # the invoker's accounting (nothing more is expected)
                pass
    finally:
        await events.aclose()


routes = [Route("/v1/deployments/{name}/invoke", invoke, methods=["POST"])]
