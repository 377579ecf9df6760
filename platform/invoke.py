"""Run one generation on a replica and account for it, whatever happens.

The invoker leases a replica from the router, streams ``/generate`` from its worker, and
on every way out (finished, worker error, worker lost, client gone) submits one usage
record with the token counts the worker reported last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import httpx

from hotpool.billing.deployments import DeploymentSpec
from hotpool.billing.ledger import UsageRecord
from hotpool.platform.answer_bounds import bounded
from hotpool.platform.errors import APIError
from hotpool.platform.inflight import OpenRequest
from hotpool.platform.ledger_writer import LedgerWriter
from hotpool.platform.metrics import Metrics
from hotpool.platform.router import Affinity, Lease, Router, Target
from hotpool.platform.schemas import CompletionCall
from hotpool.platform.worker_mux import WorkerMuxes, WorkerRefused
from hotpool.worker.protocol import GenerateEvent, GenerateRequest, Usage

log = logging.getLogger("hotpool.invoke")
requests_log = logging.getLogger("hotpool.requests")


@dataclass(frozen=True)
class Caller:
    """Who made a request, for the ledger and the request log."""

    api_key_id: int | None = None
    key_prefix: str | None = None
    client_request_id: str | None = None  # the client's own x-request-id, if well-formed
    # A conversation's id (the x-session-id header): its turns stick to one replica, where
    # the earlier turns are cached (OpenAI's `user` does the same when there is no header).
    session: str | None = None


@dataclass
class Served:
    """What served a request, filled in once a replica is leased (before the first event
    reaches the caller): the version the response reports in ``x-hotpool-version``."""

    version: int | None = None


def version_header(served: Served) -> dict[str, str]:
    """The response header naming the deployment version that served the request."""
    return {} if served.version is None else {"x-hotpool-version": str(served.version)}


MAX_RETRIES = 2  # replicas tried again for one request before its first token


@dataclass
class _Tally:
    n: int = 1  # choices the request asked for
    t0: float = field(default_factory=time.monotonic)
    usage: Usage = field(default_factory=Usage)
    ttft: float | None = None
    finishes: dict[int, str] = field(default_factory=dict)  # choice index -> finish reason
    finish: str | None = None  # the request's: set once every choice finished (or one failed)
    status: str = "error"
    error: str | None = None
    lease: Lease | None = None
    delivered: bool = False  # an event reached the caller: no retry from here on
    invalid: bool = False  # refused with a 400 before any event: not a request to bill
    last_token: dict[int, float] = field(default_factory=dict)  # choice -> its last token's time
    texts: dict[int, list[str]] | None = None  # choice -> its output, kept only to be logged


class Invoker:
    def __init__(
        self,
        router: Router,
        client: httpx.AsyncClient,
        ledger: LedgerWriter,
        metrics: Metrics,
        muxes: WorkerMuxes,
        log_prompts: int = 0,
    ) -> None:
        self.router = router
        self.client = client  # aborts; the streams themselves go through `muxes`
        self.muxes = muxes
        self.ledger = ledger
        self.metrics = metrics
        # HOTPOOL_LOG_PROMPTS: 0, or the characters of each prompt and output logged at
        # debug level (for debugging a deployment; off by default, as prompts are the users').
        self.log_prompts = log_prompts
        self._background: set[asyncio.Task[None]] = set()

    async def generate(
        self,
        target: Target | DeploymentSpec,
        call: CompletionCall,
        request_id: str,
        caller: Caller | None = None,
        served: Served | None = None,
    ) -> AsyncIterator[GenerateEvent]:
        """Events from the worker; raises :class:`APIError` before the first one on failure.

        ``target``: the version to run it on (:meth:`Router.choose`); a bare spec is its
        stable version. Retries stay on that version.

        A replica that fails before anything reached the client (its worker died, or
        refused the connection) costs the request nothing: it is retried on another
        replica, up to ``MAX_RETRIES`` times. Once a token is out, a failure ends the
        stream with an error and the ledger keeps what was delivered as ``partial``."""
        if isinstance(target, DeploymentSpec):
            target = Target(target, not_version=target.canary_version)
        spec = target.spec
        call = bounded(call, spec)
        tally = _Tally(n=call.params.n)
        if self.log_prompts and requests_log.isEnabledFor(logging.DEBUG):
            tally.texts = {}
        request = GenerateRequest(
            request_id, call.params, call.prompt, call.messages,
            call.tools, call.tool_choice, call.parallel_tool_calls,
        )  # fmt: skip
        caller = caller or Caller()
        affinity = Affinity(request, caller.session or call.user)
        failed: Lease | None = None
        attempt = 0
        # Journalled until its record is safe: a crash from here on bills it as `partial`.
        self.ledger.begin(
            OpenRequest(
                request_id, spec.name, call.endpoint, spec.tenant_id,
                caller.api_key_id, caller.client_request_id,
            )
        )  # fmt: skip
        try:
            while True:
                try:
                    events = self._attempt(target, request, tally, failed, served, affinity)
                    async for event in events:
                        yield event
                    break
                except httpx.TransportError as exc:
                    lease = tally.lease
                    if tally.delivered or attempt >= MAX_RETRIES or lease is None:
                        raise
                    if lease.replica.retired:  # never again under the name: a new one's
                        raise APIError(
                            404, f"deployment {spec.name!r} was deleted",
                            code="deployment_not_found",
                        ) from exc  # fmt: skip
                    attempt += 1
                    failed = lease
                    dead = await self.router.pool.worker_failed(lease.replica)
                    if not dead:  # it may still be running this request: stop it there
                        self._abort_later(lease, request_id)
                    log.warning(
                        "request %s: replica %s failed before its first token (%r; worker %s);"
                        " retrying", request_id, lease.replica.id, exc,
                        "dead" if dead else "alive",
                    )  # fmt: skip
            if tally.finish is None:
                tally.status = "partial" if tally.usage.completion_tokens else "error"
                tally.error = "the worker ended the stream without finishing"
                raise APIError(502, tally.error, type="api_error")
        except (asyncio.CancelledError, GeneratorExit):
            if tally.finish is None:  # the client went away mid-generation
                tally.status = "cancelled"
                self._abort_later(tally.lease, request_id)
            raise
        except APIError as exc:
            tally.error = tally.error or exc.message
            # The client's error, found only now (a prompt past the context, a template
            # the messages break): no request in the ledger, as the API's other 400s.
            tally.invalid = exc.status == 400 and not tally.delivered
            raise
        except httpx.HTTPError as exc:
            tally.status = "partial" if tally.usage.completion_tokens else "error"
            tally.error = f"lost the worker: {exc!r}"
            if tally.lease is not None:
                await self.router.pool.worker_failed(tally.lease.replica, settle_s=0.0)
            raise APIError(
                502, f"the replica serving {spec.name!r} failed: {exc!r}", type="api_error"
            ) from exc
        finally:
            if tally.invalid:
                self.ledger.withdraw(request_id)
            else:
                self._account(spec, call, request_id, tally, caller)

    async def _attempt(
        self,
        target: Target,
        request: GenerateRequest,
        tally: _Tally,
        avoid: Lease | None,
        served: Served | None,
        affinity: Affinity | None = None,
    ) -> AsyncIterator[GenerateEvent]:
        spec = target.spec
        replica = avoid.replica if avoid else None
        async with self.router.lease(target, replica, affinity) as lease:
            if served is not None:
                served.version = lease.replica.generation
            if tally.lease is None or not tally.delivered:
                # Queue time and cold start count from the first attempt.
                previous = tally.lease
                tally.lease = (
                    lease
                    if previous is None
                    else replace(
                        lease,
                        queue_seconds=lease.queue_seconds + previous.queue_seconds,
                        cold_start=lease.cold_start or previous.cold_start,
                    )
                )
            async with aclosing(self._stream(lease, request)) as stream:
                async for event in stream:
                    if lease.work is not None:  # the replica's backlog, as it goes down
                        lease.work.prefilled()
                        lease.work.produced(len(event.token_ids))
                    now = time.monotonic()
                    _tally_event(tally, event, now)
                    if tally.texts is not None and event.text:
                        tally.texts.setdefault(event.index, []).append(event.text)
                    if (gap := _token_gap(tally, event, now)) is not None:
                        self.metrics.observe_token_gap(spec.name, gap, len(event.token_ids))
                    if (u := event.usage) is not None:
                        rid = request.request_id
                        self.ledger.progress(
                            rid, u.prompt_tokens, u.completion_tokens, u.cached_tokens
                        )
                    tally.delivered = True
                    yield event

    async def _stream(self, lease: Lease, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        rid = request.request_id
        async with self.muxes.generate(lease.replica.address, rid, request.to_json()) as stream:
            try:
                async for event in stream:
                    yield event
            except WorkerRefused as exc:
                if exc.status == 503:  # shutting down: another replica, as if unreachable
                    raise httpx.ConnectError(f"the worker is shutting down: {exc}") from exc
                text_field = "messages" if request.messages is not None else "prompt"
                raise _refused(exc, text_field) from exc

    async def close(self) -> None:
        await self.muxes.aclose()

    def _abort_later(self, lease: Lease | None, request_id: str) -> None:
        # Runs outside the cancelled request's scope, where awaiting is still allowed.
        if lease is None or lease.replica.worker is None:
            return
        url = f"{lease.replica.address}/abort/{request_id}"

        async def abort() -> None:
            try:
                await self.client.post(url, timeout=5.0)
            except httpx.HTTPError as exc:
                log.info("abort of %s not delivered: %s", request_id, exc)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _account(
        self, spec: DeploymentSpec, call: CompletionCall, request_id: str, t: _Tally, c: Caller
    ) -> None:
        total = time.monotonic() - t.t0
        lease = t.lease
        u = t.usage
        if t.finish is not None:  # what a whole request produces: the next ones' estimate
            self.router.finished(spec.name, u.completion_tokens / max(call.params.n, 1))
        queue = lease.queue_seconds if lease else None
        cold = bool(lease and lease.cold_start)
        # The version of the replica that served it (the one asked for, if none did).
        version = lease.replica.generation if lease else spec.generation
        self.ledger.submit(
            UsageRecord(
                request_id=request_id,
                deployment=spec.name,
                endpoint=call.endpoint,
                status=t.status,
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_tokens=u.cached_tokens,
                tenant_id=spec.tenant_id,
                queue_seconds=queue,
                ttft_seconds=t.ttft,
                total_seconds=total,
                cold_start=cold,
                error=t.error,
                api_key_id=c.api_key_id,
                client_request_id=c.client_request_id,
                version=version,
            )
        )
        self.metrics.observe_request(spec.name, t.status, u, t.ttft, total, queue, version)
        # One structured line per request (JSON with HOTPOOL_LOG_FORMAT=json): never the
        # prompt, the output or the key itself, only its prefix.
        requests_log.info(
            "%s %s %s: %d+%d tokens in %.3fs",
            request_id, spec.name, t.status, u.prompt_tokens, u.completion_tokens, total,
            extra={
                "request_id": request_id, "client_request_id": c.client_request_id,
                "tenant_id": spec.tenant_id, "api_key": c.key_prefix,
                "deployment": spec.name, "version": version, "endpoint": call.endpoint,
                "status": t.status,
                "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                "completion_tokens": u.completion_tokens, "queue_seconds": queue,
                "ttft_seconds": t.ttft, "total_seconds": round(total, 6),
                "cold_start": cold, "error": t.error,
            },
        )  # fmt: skip
        if t.texts is not None:
            self._log_prompt(request_id, spec.name, call, t.texts)

    def _log_prompt(
        self, request_id: str, deployment: str, call: CompletionCall, texts: dict[int, list[str]]
    ) -> None:
        """The request's prompt (or messages) and output, each text cut to ``log_prompts``
        characters: in the message for text logs, and as fields for JSON ones."""
        limit = self.log_prompts
        prompt = None if call.prompt is None else _cut(call.prompt, limit)
        messages = (
            None
            if call.messages is None
            else [{"role": m.role, "content": _cut(m.content, limit)} for m in call.messages]
        )
        output = [_cut("".join(texts.get(i, ())), limit) for i in range(call.params.n)]
        requests_log.debug(
            "%s %s prompt=%r output=%r",
            request_id, deployment, prompt if messages is None else messages, output,
            extra={"request_id": request_id, "deployment": deployment, "prompt": prompt,
                   "messages": messages, "output": output},
        )  # fmt: skip


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


_COMPLETED = ("stop", "length", "tool_calls")  # the finishes of a request that went well


def _tally_event(tally: _Tally, event: GenerateEvent, now: float | None = None) -> None:
    if event.usage is not None:
        tally.usage = event.usage
    if tally.ttft is None and event.token_ids:
        tally.ttft = (time.monotonic() if now is None else now) - tally.t0
    if event.finish_reason is None:
        return
    tally.finishes[event.index] = event.finish_reason
    if event.finish_reason == "error":  # one failed choice ends the request
        tally.finish, tally.status, tally.error = "error", "error", event.error
    elif len(tally.finishes) >= tally.n and tally.finish is None:
        done = tally.finishes.values()
        tally.finish = event.finish_reason
        tally.status = "completed" if all(f in _COMPLETED for f in done) else "error"


def _token_gap(tally: _Tally, event: GenerateEvent, now: float) -> float | None:
    """Seconds since the previous tokens of this event's choice; None for a choice's first
    tokens (that wait is the TTFT) and for events that carry none.

    Per choice: the n choices of one request interleave, and a gap measured across two of
    them would be no token's latency."""
    if not event.token_ids:
        return None
    previous = tally.last_token.get(event.index)
    tally.last_token[event.index] = now
    return None if previous is None else now - previous


def _refused(exc: WorkerRefused, text_field: str) -> APIError:
    """The client's error for a worker's refusal; ``text_field`` names the request's text
    (``messages`` or ``prompt``), what a request past the model's context is blamed on, as
    OpenAI does."""
    if exc.status == 400:  # the request itself is bad (prompt too long, template failure)
        param = text_field if exc.code == "context_length_exceeded" else None
        return APIError(400, exc.message, param=param, code=exc.code)
    return APIError(502, f"worker error ({exc.status}): {exc.message}", type="api_error")
