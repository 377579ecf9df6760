"""Who is calling: API keys, scopes and the tenant every object access is scoped to.

Keys arrive as ``Authorization: Bearer hp_...`` (what the ``openai`` client sends) and are
checked against their SHA-256 hash in SQL (:mod:`hotpool.billing.keys`). Each route states
the scope it needs with :func:`authorize`; the answer is a :class:`Principal` whose tenant
scopes every lookup, so another tenant's deployment is a 404, never a 403 that confirms it
exists.

``HOTPOOL_AUTH=none`` (the default when listening on loopback only) is the laptop mode:
no keys, every caller is the default tenant with every scope. It says so at start-up and
on every response (``x-hotpool-auth: off``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError
from starlette.requests import Request

from hotpool.billing.deployments import DeploymentSpec
from hotpool.billing.keys import ApiKeyRecord, KeyStore
from hotpool.billing.models import DEFAULT_TENANT_ID
from hotpool.platform.errors import APIError
from hotpool.platform.invoke import Caller

log = logging.getLogger("hotpool.auth")

TOUCH_EVERY_S = 60.0  # last_used_at is kept to the minute: one UPDATE per key per minute
# A key checked in SQL is trusted this long without asking again (a database round trip
# on every request is most of what auth costs). Revoking through this server's API takes
# effect at once; through the CLI or another control plane, within this many seconds.
KEY_CACHE_S = 2.0
# A key in use is checked again in the background once its check is this old, so under
# steady traffic no request waits for the database; the check a request trusts is still
# never older than KEY_CACHE_S.
KEY_REFRESH_S = 1.0
MAX_CACHED_KEYS = 10_000


@dataclass(frozen=True)
class Principal:
    tenant_id: int
    key: ApiKeyRecord | None  # None: local-only mode, no keys

    def allows(self, scope: str) -> bool:
        return self.key is None or self.key.allows(scope)

    @property
    def key_id(self) -> int | None:
        return self.key.id if self.key else None

    @property
    def is_admin(self) -> bool:
        return self.allows("admin")

    @property
    def is_operator(self) -> bool:
        """Whether it reaches across tenants (the platform's operator; everyone in
        local-only mode)."""
        return self.allows("operator")


LOCAL = Principal(DEFAULT_TENANT_ID, None)


@dataclass(frozen=True)
class _Checked:
    key: ApiKeyRecord | None  # None: unknown or revoked
    at: float  # when the lookup that found it started (the database was at least this fresh)


# What a key lookup raises when the database cannot answer (it is down, unreachable, out of
# connections): the request is then answered from the grace period, or 503. Anything else
# is a bug, and stays a 500.
DATABASE_ERRORS = (SQLAlchemyError, OSError, TimeoutError)


class Authenticator:
    """Keys are checked in SQL at most once per KEY_CACHE_S per key, and one lookup at a time.

    Why the single flight: when a cached check expires under load, every request of the
    burst missed at once and each sent its own lookup to the thread pool (32 streams: 32
    queries, the last one waiting behind the other 31), which showed as tens of ms of TTFT.
    Now they share one lookup, and a key in use is re-checked ahead of its expiry.

    Why the grace period: the database is not on the serving path (usage goes to the spool
    while it is down), and a key check must not put it there. A lookup waits at most
    ``timeout_s``; while lookups fail, a key checked within ``grace_s`` is answered as last
    seen (an active key served, a revoked or unknown one refused) without waiting, one
    lookup at a time probes the database, and a key never seen is a 503 with Retry-After.
    """

    def __init__(
        self,
        keys: KeyStore,
        enabled: bool,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 2.0,
        grace_s: float = 300.0,
    ) -> None:
        self.keys = keys
        self.enabled = enabled
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self._clock = clock
        self._touched: dict[int, float] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._cache: dict[bytes, _Checked] = {}  # sha256(key) -> its last check
        self._lookups: dict[bytes, asyncio.Task[ApiKeyRecord | None]] = {}
        # Bumped by forget(): a lookup that started before a revocation does not cache
        # the key it read (it may have read it before the revocation committed).
        self._epoch = 0
        self.database_failing = False  # the last lookup to end failed or timed out
        self.served_from_grace = 0  # requests answered from the grace period

    async def principal(self, request: Request) -> Principal:
        if not self.enabled:
            return LOCAL
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401,
                "You didn't provide an API key. Send it as `Authorization: Bearer hp_...`; "
                "`hotpool keys create` makes one.",
                code="missing_api_key",
            )
        key = await self._authenticate(token)
        if key is None:
            shown = token[:11] + "..." if len(token) > 11 else token[:3] + "..."
            raise APIError(
                401, f"Incorrect API key provided: {shown}; it is unknown or revoked.",
                code="invalid_api_key",
            )  # fmt: skip
        self._touch(key)
        return Principal(key.tenant_id, key)

    async def _authenticate(self, token: str) -> ApiKeyRecord | None:
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        hit = self._cache.get(digest)
        if hit is not None:
            age = self._clock() - hit.at
            if age < KEY_CACHE_S:
                if age >= KEY_REFRESH_S and digest not in self._lookups:
                    self._lookup(digest, token)  # in the background; this request goes on
                return hit.key
        if self.database_failing:
            if hit is not None and self._clock() - hit.at < self.grace_s:
                self._probe(digest, token)
                return self._from_grace(hit)
            if self._lookups and digest not in self._lookups:
                # A lookup is already finding out whether the database is back: one more
                # would only hold another thread on a database that does not answer.
                raise self._unavailable()
        try:
            # shield: a caller that gives up (its client left, or the timeout) must not
            # cancel the lookup that the other callers of the same key are waiting on.
            return await asyncio.wait_for(
                asyncio.shield(self._lookup(digest, token)), self.timeout_s
            )
        except DATABASE_ERRORS as exc:
            if isinstance(exc, TimeoutError):
                self.database_failing = True
            if hit is not None and self._clock() - hit.at < self.grace_s:
                return self._from_grace(hit)
            raise self._unavailable() from None

    def _unavailable(self) -> APIError:
        return APIError(
            503,
            "API keys cannot be checked right now: the database is not answering. Retry "
            f"shortly (keys checked in the last {self.grace_s:g} s keep working meanwhile).",
            code="auth_unavailable",
            retry_after_s=5,
        )

    def _from_grace(self, hit: _Checked) -> ApiKeyRecord | None:
        self.served_from_grace += 1
        if self.served_from_grace % 1000 == 1:
            log.warning(
                "the database is not answering key checks: honouring keys as last checked "
                "(up to %g s ago); %d requests so far",
                self.grace_s,
                self.served_from_grace,
            )
        return hit.key

    def _probe(self, digest: bytes, token: str) -> None:
        """While lookups fail: one lookup at a time in the background finds out whether the
        database is back (more would only stack threads up on a frozen one)."""
        if not self._lookups:
            self._lookup(digest, token)

    def _lookup(self, digest: bytes, token: str) -> asyncio.Task[ApiKeyRecord | None]:
        """The lookup of ``token`` in flight, started if there is none."""
        task = self._lookups.get(digest)
        if task is not None:
            return task
        started, epoch = self._clock(), self._epoch

        async def lookup() -> ApiKeyRecord | None:
            try:
                key = await asyncio.to_thread(self.keys.authenticate, token)
            except DATABASE_ERRORS:
                self.database_failing = True
                raise
            finally:
                if self._lookups.get(digest) is task:  # not if forget() let a new one start
                    del self._lookups[digest]
            self.database_failing = False
            if epoch == self._epoch:
                self._remember(digest, _Checked(key, started))
            elif key is None:
                self._cache.pop(digest, None)
            return key

        task = asyncio.get_running_loop().create_task(lookup())
        self._lookups[digest] = task
        # A background refresh's failure (database down) is logged here; the cached
        # check stands until it expires, and then the grace period or a 503 answers.
        task.add_done_callback(_log_failure)
        return task

    def _remember(self, digest: bytes, checked: _Checked) -> None:
        """Cache a check. An unknown or revoked key is remembered too (while the database is
        down it stays a 401, not a 503), but a flood of made-up keys never pushes out the
        real ones, whose checks the grace period serves from."""
        if len(self._cache) >= MAX_CACHED_KEYS:
            if checked.key is None:
                return
            self._cache = {d: c for d, c in self._cache.items() if c.key is not None}
            if len(self._cache) >= MAX_CACHED_KEYS:  # keys are few: this only bounds a flood
                self._cache.clear()
        self._cache[digest] = checked

    def forget(self, key_id: int) -> None:
        """Drop a revoked key from the cache: it fails from the next request on."""
        self._epoch += 1
        self._cache = {d: v for d, v in self._cache.items() if v.key is None or v.key.id != key_id}
        # A lookup in flight may have read the key before the revocation committed: the
        # requests waiting on it take its answer, but later ones start a lookup of their own.
        self._lookups.clear()

    def _touch(self, key: ApiKeyRecord) -> None:
        if self.database_failing:  # bookkeeping can wait; a thread held on it cannot
            return
        now = time.monotonic()
        if now - self._touched.get(key.id, -TOUCH_EVERY_S) < TOUCH_EVERY_S:
            return
        self._touched[key.id] = now

        async def touch() -> None:
            try:
                await asyncio.to_thread(self.keys.touch, key.id)
            except Exception:  # bookkeeping only: never fail a request for it
                log.warning("could not record last use of key %s", key.prefix, exc_info=True)

        task = asyncio.get_running_loop().create_task(touch())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _log_failure(task: asyncio.Task[ApiKeyRecord | None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("could not check an API key in the database: %s", exc)


async def authorize(request: Request, scope: str) -> Principal:
    """The caller, if its key has ``scope`` (admin has every scope); else 401 or 403."""
    auth: Authenticator = request.app.state.services.auth
    principal = await auth.principal(request)
    if not principal.allows(scope):
        raise APIError(
            403,
            f"this API key lacks the `{scope}` scope (it has "
            f"{', '.join(sorted(principal.key.scopes)) if principal.key else 'none'})",
            type="permission_error",
            code="insufficient_scope",
        )
    request.scope.setdefault("state", {})["principal"] = principal
    return principal


SESSION_HEADER = "x-session-id"
MAX_SESSION_CHARS = 256


def caller(request: Request, principal: Principal) -> Caller:
    state = request.scope.get("state", {})
    session = request.headers.get(SESSION_HEADER)
    if session is not None and not (0 < len(session) <= MAX_SESSION_CHARS):
        raise APIError(
            400, f"`{SESSION_HEADER}` must be 1-{MAX_SESSION_CHARS} characters",
            param=SESSION_HEADER, code="invalid_session_id",
        )  # fmt: skip
    return Caller(
        api_key_id=principal.key_id,
        key_prefix=principal.key.prefix if principal.key else None,
        client_request_id=state.get("client_request_id"),
        session=session,
    )


def owned(spec: DeploymentSpec | None, principal: Principal) -> DeploymentSpec | None:
    """``spec`` if it belongs to the caller's tenant: others' deployments do not exist."""
    if spec is None or spec.tenant_id != principal.tenant_id:
        return None
    return spec
