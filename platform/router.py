"""Pick a replica for each request; hold requests through a cold start, within bounds.

Each request first gets its version (:meth:`Router.choose`): while a canary runs, it takes
its share of the requests, by a hash of the ``user`` field when there is one (so one user's
conversation stays on one version) and at random otherwise. Versions have replicas of their
own; a canary request is served by the canary only, a stable request never by the canary.

Among a version's ready replicas, a request goes where its prompt's prefix is cached
(:meth:`Router._pick`): each replica's prefix set (its worker's reported block hashes) is
matched against the prompt's hashes (:class:`PromptHasher`), and the share of the prompt
cached there is weighed against the replica's load; a replica at its
``target_concurrency`` is never chosen for its cache. With nothing cached anywhere, a
conversation (OpenAI's ``user``) sticks to one replica by rendezvous hashing, so its next
turn finds its history; else the ready replica with the fewest outstanding requests wins.
With none ready, the request
waits (at most ``max_queue`` per deployment, at most ``queue_timeout_s``) for the replica
the pool is starting, starting one if there is none; a full queue is a 429 and an expired
wait a 503, both with ``Retry-After``, never a hang. Admission also counts tokens
(:meth:`Router._admit`): at ``max_replicas``, a request whose prompt would wait longer than
``queue_timeout_s`` behind the prompts queued on its replica (at that replica's measured
prefill rate) is a 429 at once, rather than a request that times out after holding a slot.
Demand beyond one replica is the autoscaler's: the router wakes it whenever requests queue
or a replica passes its target concurrency.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from hotpool.billing.deployments import DeploymentSpec
from hotpool.platform.errors import APIError
from hotpool.platform.prompt_hasher import PromptHasher, PromptKey
from hotpool.pool.capacity import rates
from hotpool.pool.pool import WorkerPool
from hotpool.pool.replica import Replica, ReplicaState
from hotpool.worker.prompt import fewest_tokens, prompt_bytes
from hotpool.worker.protocol import GenerateRequest


@dataclass(frozen=True)
class Target:
    """Which version a request goes to: ``spec`` as that version's replicas run it
    (``generation`` is the version). ``strict``: only that version may serve it (a canary
    request); otherwise, during a roll-over, older replicas may, but never ``not_version``
    (a stable request never lands on the canary)."""

    spec: DeploymentSpec
    strict: bool = False
    not_version: int | None = None

    @property
    def version(self) -> int:
        return self.spec.generation


# What one running request adds to a replica's cost, in prompt tokens: a decode step's
# share of the batch it rides in, roughly a prefill chunk of this size on the CPU and less
# on a GPU; small against a long prompt's miss, large enough to break ties toward the
# emptier replica.
DECODE_TOKENS = 16
DEFAULT_OUTPUT_TOKENS = 128.0  # a request's expected output before its deployment has a mean
MAX_EXPECTED_OUTPUT = 4096.0
OUTPUT_ALPHA = 0.05  # the mean follows about the last twenty requests
CHARS_PER_TOKEN = 4
MAX_ESTIMATE = 1 << 17  # prompt tokens one request is counted for before any replica loaded


def user_share(name: str, user: str) -> float:
    """Where ``user`` falls in [0, 100) for deployment ``name``: stable for a user, so the
    same user stays on one version; raising the canary's percent only moves users onto it."""
    digest = hashlib.sha256(f"{name}\0{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100


@dataclass(frozen=True)
class Affinity:
    """What routes a request to a replica beyond load: its prompt (whose cached prefix a
    replica may hold) and the conversation it belongs to (OpenAI's ``user``)."""

    request: GenerateRequest
    user: str | None = None


@dataclass(eq=False)
class Work:
    """What a request still costs its replica, by the router's estimate: the prompt tokens
    it computes there (the prompt less its cached prefix), until the first token, and the
    output tokens it is expected to produce (``min(max_tokens, the deployment's mean)``),
    as they come. Counted in the replica's ``queued_tokens`` and ``queued_output_tokens``:
    the backlog token-aware scaling weighs."""

    replica: Replica
    prompt: int = 0
    output: int = 0

    def __post_init__(self) -> None:
        self.replica.queued_tokens += self.prompt
        self.replica.queued_output_tokens += self.output

    def prefilled(self) -> None:
        self.replica.queued_tokens -= self.prompt
        self.prompt = 0

    def produced(self, tokens: int) -> None:
        n = min(tokens, self.output)
        self.replica.queued_output_tokens -= n
        self.output -= n

    def done(self) -> None:
        self.prefilled()
        self.produced(self.output)


@dataclass(frozen=True)
class Lease:
    replica: Replica
    queue_seconds: float
    cold_start: bool  # this request waited for a replica to start
    work: Work | None = None  # prefilled() at the first token, produced() as tokens come


class Router:
    def __init__(
        self,
        pool: WorkerPool,
        max_queue: int,
        queue_timeout_s: float,
        on_demand: Callable[[], None] = lambda: None,
        routing: str = "cache_aware",
    ) -> None:
        self.pool = pool
        self.routing = routing  # cache_aware or least_loaded (HOTPOOL_ROUTING)
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.on_demand = on_demand  # wakes the autoscaler
        self.waiting: Counter[str] = Counter()
        self.waiting_for: Counter[tuple[str, int]] = Counter()  # by (deployment, version)
        self.rng = random.Random()
        self._stopping = asyncio.Event()
        self.hasher = PromptHasher(pool.client)
        self.decisions: Counter[tuple[str, str]] = Counter()  # (deployment, why) -> requests
        self.output_means: dict[str, float] = {}  # output tokens per choice, per deployment
        # Tokens of requests waiting for a replica, per (deployment, version): prompt, output.
        self.waiting_tokens: Counter[tuple[str, int, str]] = Counter()

    def begin_shutdown(self) -> None:
        """The server is stopping: requests waiting for a replica get a 503 at once (no
        cold start can finish: a new worker cannot register once the listener is closed),
        and so does any request that would have to wait."""
        self._stopping.set()

    def queued(self, deployment: str) -> int:
        return self.waiting[deployment]

    def queued_for(self, deployment: str, version: int) -> int:
        return self.waiting_for[(deployment, version)]

    def waiting_work(self, deployment: str, version: int) -> tuple[int, int]:
        """Prompt and output tokens of the requests waiting for a replica of a version."""
        key = (deployment, version)
        return self.waiting_tokens[(*key, "prompt")], self.waiting_tokens[(*key, "output")]

    def choose(
        self, spec: DeploymentSpec, canary: DeploymentSpec | None, user: str | None = None
    ) -> Target:
        """The version a request goes to: ``canary`` (``spec.at_version`` of the canary)
        for ``spec.canary_percent`` percent of requests, else the stable ``spec``."""
        percent = spec.canary_percent
        if canary is not None and percent:
            share = user_share(spec.name, user) if user else self.rng.random() * 100
            if share < percent:
                return Target(canary, strict=True)
        return Target(spec, not_version=spec.canary_version)

    @asynccontextmanager
    async def lease(
        self,
        target: Target | DeploymentSpec,
        avoid: Replica | None = None,
        affinity: Affinity | None = None,
    ) -> AsyncIterator[Lease]:
        """A replica for one request; ``avoid``: one that just failed it (used only if it is
        the only one ready)."""
        if isinstance(target, DeploymentSpec):
            target = Target(target, not_version=target.canary_version)
        t0 = time.monotonic()
        if affinity is not None:
            self._check_context(target.spec, affinity.request)
        try:
            if affinity is not None and self.routing == "cache_aware":
                replicas = self.pool.replicas(target.spec.name)
                await self.hasher.prepare(replicas, affinity.request)
            (replica, work), cold = await self._acquire(target, t0, avoid, affinity)
        finally:
            if affinity is not None:
                self.hasher.forget(affinity.request.request_id)
        try:
            yield Lease(replica, time.monotonic() - t0, cold, work)
        finally:
            work.done()
            replica.inflight -= 1
            replica.last_used = time.monotonic()

    async def _acquire(
        self, target: Target, t0: float, avoid: Replica | None, affinity: Affinity | None
    ) -> tuple[tuple[Replica, Work], bool]:
        spec = target.spec
        max_queue = spec.max_queue or self.max_queue
        timeout_s = spec.queue_timeout_s or self.queue_timeout_s
        ready = self._pick(target, avoid, affinity)
        if ready is not None:
            self._admit(spec, *ready, timeout_s)
            return ready, False
        if self.waiting[spec.name] >= max_queue:
            # Over the deployment's limit, not the server's failure: a 429, which the openai
            # client retries after Retry-After, as it does OpenAI's own "overloaded".
            raise APIError(
                429, f"deployment {spec.name!r} has {max_queue} requests queued (its max_queue);"
                " retry later", code="queue_full", retry_after_s=5,
            )  # fmt: skip
        self.waiting[spec.name] += 1
        self.waiting_for[(spec.name, spec.generation)] += 1
        tokens = self._prompt_estimate(affinity, spec), self._expected_output(spec.name, affinity)
        self.waiting_tokens[(spec.name, spec.generation, "prompt")] += tokens[0]
        self.waiting_tokens[(spec.name, spec.generation, "output")] += tokens[1]
        self.on_demand()
        try:
            while True:
                if self._stopping.is_set():
                    raise _shutting_down()
                starting = [
                    r
                    for r in self.pool.replicas(spec.name)
                    if r.starting and r.generation == spec.generation
                ]
                if starting:
                    replica = min(starting, key=lambda r: r.requested_at)
                else:
                    replica = self.pool.scale_up(spec, reason="request", canary=target.strict)
                remaining = timeout_s - (time.monotonic() - t0)
                try:
                    await self._wait_ready(replica, max(remaining, 0.0))
                except TimeoutError:
                    wait = f"{timeout_s:g}s"
                    raise APIError(
                        503, f"no replica of {spec.name!r} became ready within {wait}",
                        code="queue_timeout", retry_after_s=10,
                    ) from None  # fmt: skip
                if replica.retired:  # deleted while this request waited: nothing to retry
                    # (and never a replica of a new deployment that took the name since)
                    raise APIError(
                        404, f"deployment {spec.name!r} was deleted", code="deployment_not_found"
                    )
                picked = self._pick(target, avoid, affinity)
                if picked is not None:
                    return picked, True
                if replica.error is not None and replica.state is not ReplicaState.QUEUED:
                    raise APIError(503, f"cold start of {spec.name!r} failed: {replica.error}",
                                   code="cold_start_failed", retry_after_s=10)  # fmt: skip
        finally:
            self.waiting[spec.name] -= 1
            self.waiting_for[(spec.name, spec.generation)] -= 1
            self.waiting_tokens[(spec.name, spec.generation, "prompt")] -= tokens[0]
            self.waiting_tokens[(spec.name, spec.generation, "output")] -= tokens[1]

    def _admit(self, spec: DeploymentSpec, replica: Replica, work: Work, timeout_s: float) -> None:
        """Admission in tokens: a 429 (the claim on ``replica`` released) when the prompt
        tokens queued there ahead of this request would take longer than ``timeout_s`` to
        prefill at the replica's measured rate and the version already runs its
        ``max_replicas`` (below that, the autoscaler adds replicas and the request waits
        its turn). A few 8k-token prompts fill a replica as dozens of chats do; a request
        count (``max_queue``, ``target_concurrency``) cannot see it."""
        measured = rates(replica.capacity)
        if measured is None:
            return  # no step measured yet: nothing to predict with
        wait = (replica.queued_tokens - work.prompt) / measured.prefill
        if wait <= timeout_s:
            return
        live = [
            r
            for r in self.pool.replicas(spec.name)
            if r.generation == replica.generation and r.state is not ReplicaState.DRAINING
        ]
        if len(live) < spec.max_replicas:
            return
        work.done()
        replica.inflight -= 1
        self.decisions[(spec.name, "overloaded")] += 1
        raise APIError(
            429, f"deployment {spec.name!r} is at capacity: ~{wait:.0f}s of prompts are queued"
            f" on its replicas (max_replicas {spec.max_replicas}, measured"
            f" {measured.prefill:.0f} prompt tokens/s each); retry later",
            code="overloaded", retry_after_s=max(1, math.ceil(wait - timeout_s)),
        )  # fmt: skip

    async def _wait_ready(self, replica: Replica, timeout_s: float) -> None:
        """Until ``replica`` is ready (or failed); TimeoutError after ``timeout_s``; a 503
        if the server begins to stop meanwhile."""
        ready = asyncio.ensure_future(replica.ready.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait(
                (ready, stopping), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            ready.cancel()
            stopping.cancel()
        if replica.ready.is_set():
            return
        if self._stopping.is_set():
            raise _shutting_down()
        raise TimeoutError

    def _pick(
        self, target: Target, avoid: Replica | None, affinity: Affinity | None = None
    ) -> tuple[Replica, Work] | None:
        spec = target.spec
        ready = [
            r
            for r in self.pool.replicas(spec.name)
            if r.state is ReplicaState.READY and r.generation != target.not_version
        ]
        current = [r for r in ready if r.generation == spec.generation]
        # During a roll-over the new version takes requests as soon as it is ready; until
        # then the old one serves (never for a canary request: that one waits for its own).
        ready = current if current or target.strict else ready
        if not ready:
            return None
        best, prompt = self._best(spec, ready, avoid, affinity)
        best.inflight += 1  # claimed before any await, so the autoscaler sees it busy
        work = Work(best, prompt, self._expected_output(spec.name, affinity))
        if best.inflight > spec.target_concurrency:
            self.on_demand()
        return best, work

    def _expected_output(self, deployment: str, affinity: Affinity | None) -> int:
        """Output tokens a request will produce: its ``max_tokens`` (per choice), capped by
        the mean its deployment's requests produced."""
        if affinity is None:
            return 0
        params = affinity.request.params
        mean = self.output_means.get(deployment, DEFAULT_OUTPUT_TOKENS)
        cap = params.max_tokens if params.max_tokens is not None else MAX_EXPECTED_OUTPUT
        return round(min(cap, mean)) * max(params.n, 1)

    def finished(self, deployment: str, output_tokens_per_choice: float) -> None:
        """A request's choices produced this many tokens each: the deployment's mean."""
        mean = self.output_means.get(deployment)
        x = min(float(output_tokens_per_choice), MAX_EXPECTED_OUTPUT)
        self.output_means[deployment] = x if mean is None else mean + OUTPUT_ALPHA * (x - mean)

    def _best(
        self,
        spec: DeploymentSpec,
        ready: list[Replica],
        avoid: Replica | None,
        affinity: Affinity | None,
    ) -> tuple[Replica, int]:
        """The replica for a request, and the prompt tokens it will compute there.

        Cache-aware: each replica with room (fewer than ``target_concurrency`` requests)
        costs the prompt tokens it would compute for this request (the prompt less the
        prefix it holds) plus what it has queued already (``queued_tokens``: its requests'
        uncached prompt tokens, until their first tokens) plus ``DECODE_TOKENS`` for each
        request it runs; the cheapest wins. So a cached prefix draws its requests until the
        queue in front of them costs more than computing the prefix elsewhere, and a
        replica at its target concurrency never wins for its cache. With nothing cached
        anywhere, a conversation sticks to one replica (rendezvous hashing on its id)."""
        least = min(ready, key=lambda r: (r is avoid, r.inflight))
        room = [r for r in ready if r is not avoid and r.inflight < spec.target_concurrency]
        if affinity is None or len(ready) < 2 or not room or self.routing == "least_loaded":
            if affinity is not None and len(ready) > 1:
                self.decisions[(spec.name, "least_loaded")] += 1
            return least, self._prompt_estimate(affinity, spec)
        keys: dict[tuple[str, int | None], PromptKey | None] = {}
        costs: list[tuple[int, int, Replica, PromptKey, int]] = []
        for r in room:
            at = (r.load.digest if r.load else "", r.prefixes.block_size)
            if at not in keys:  # one tokenization per snapshot, not per replica
                keys[at] = self.hasher.key(r, affinity.request)
            key = keys[at]
            if key is None:
                continue
            cached = r.prefixes.matched(key.hashes) * (r.prefixes.block_size or 0)
            context = (r.load.max_model_len if r.load else None) or key.tokens
            miss = max(min(key.tokens, context) - cached, 1)  # never more than fits
            cost = r.queued_tokens + miss + DECODE_TOKENS * r.inflight
            costs.append((cost, r.inflight, r, key, miss))
        if not costs:  # the prompt cannot be weighed yet (no tokenizer here yet)
            sticky = self._sticky(room, affinity)
            best = sticky or least
            self.decisions[(spec.name, "least_loaded" if sticky is None else "user")] += 1
            return best, self._prompt_estimate(affinity, spec)
        cost, _, best, key, miss = min(costs, key=lambda c: c[:2])
        if miss < key.tokens:
            why = "prefix"
        elif (sticky := self._sticky(room, affinity)) is not None and all(
            m >= k.tokens for _, _, _, k, m in costs
        ):  # nothing cached anywhere: the conversation's replica, for its next turns
            best, why = sticky, "user"
            miss = key.tokens
        else:
            why = "least_loaded"
        best.prefixes.add(key.hashes)  # it caches them as it prefills, before any heartbeat
        self.decisions[(spec.name, why)] += 1
        return best, miss

    def _prompt_estimate(self, affinity: Affinity | None, spec: DeploymentSpec) -> int:
        """A prompt's tokens when they cannot be counted (no tokenizer here yet): ~4
        characters a token, as for English text in a BPE vocabulary, and never more than
        the context holds (a longer prompt is refused by the worker: counted whole, one
        huge prompt put every other request of the deployment into 429s meanwhile)."""
        if affinity is None:
            return 0
        req = affinity.request
        chars = len(req.prompt or "") + sum(len(m.content) for m in req.messages or ())
        limits = self._context_limits(spec)
        cap = limits[0] if limits is not None else MAX_ESTIMATE
        return min(chars // CHARS_PER_TOKEN + 1, cap)

    def _context_limits(self, spec: DeploymentSpec) -> tuple[int, int] | None:
        """The context length and the most bytes a token stands for, as a loaded replica
        of ``spec``'s version reported them (None before one has loaded)."""
        for r in self.pool.replicas(spec.name):
            load = r.load
            if r.generation == spec.generation and load is not None and load.max_model_len:
                return load.max_model_len, load.max_token_bytes or 0
        return None

    def _check_context(self, spec: DeploymentSpec, req: GenerateRequest) -> None:
        """A 400 before admission for a prompt whose bytes alone prove it longer than the
        context (what counting it would have cost everyone else: see _prompt_estimate)."""
        limits = self._context_limits(spec)
        if limits is None or not limits[1]:
            return
        context, token_bytes = limits
        nbytes = prompt_bytes(req)
        least = fewest_tokens(nbytes, token_bytes)
        if least >= context:
            raise APIError(
                400, f"this model's maximum context length is {context} tokens; the prompt "
                f"({nbytes} bytes) is at least {least} tokens",
                param="messages" if req.messages is not None else "prompt",
                code="context_length_exceeded",  # OpenAI's, as the worker's (no torch here)
            )  # fmt: skip

    @staticmethod
    def _sticky(room: list[Replica], affinity: Affinity) -> Replica | None:
        if not affinity.user:
            return None
        return max(room, key=lambda r: _rendezvous(affinity.user or "", r.id))


def _rendezvous(user: str, replica_id: str) -> int:
    """Highest-random-weight hashing: a user keeps their replica while it lives, and only
    the users of a replica that goes move."""
    return int.from_bytes(hashlib.blake2b(f"{user}\0{replica_id}".encode(), digest_size=8).digest())


def _shutting_down() -> APIError:
    return APIError(
        503, "the server is shutting down; retry shortly", code="shutting_down", retry_after_s=5
    )
