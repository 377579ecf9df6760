"""The JSON Schemas a request carries, checked against their metaschema off the event loop.

A chat request can carry a ``response_format`` schema and a ``parameters`` schema per tool.
Checking one with jsonschema is pure Python and grows with its size (about 10 µs a byte
here: a schema at the size limit takes seconds). Run on the control plane's event loop,
one such request held every other tenant's requests and streams for that long, and two
clients looping one froze them all (issue 46). So:

- the parse step (:mod:`hotpool.platform.response_format`, :mod:`hotpool.platform.tools`)
  only checks shapes and sizes, which cost nothing that grows with the schema;
- the verdict on a request's schemas is remembered by the digest of their text: clients send
  the same schema with every request, and the second costs a hash;
- a new one is checked in a separate process (a thread would still hold the GIL the event
  loop needs), at most :data:`PER_TENANT` at once for a tenant, within a deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hotpool.platform.errors import APIError, invalid

if TYPE_CHECKING:
    from hotpool.platform.schemas import CompletionCall

PROCESSES = 1  # a verdict is rarely new: one process keeps up, and costs one core at most
PER_TENANT = 2  # one tenant's checks at once; more wait for a slot (QUEUE_TIMEOUT_S)
QUEUE_TIMEOUT_S = 10.0  # waiting for a slot longer than this is a 429
CHECK_TIMEOUT_S = 30.0  # a check past this is a 400: no schema within the size limit needs it
NICENESS = 10  # added to the checker process's: it yields the cores to the serving
VERDICTS = 4096  # remembered verdicts (a digest and a short message each)


@dataclass(frozen=True)
class Verdict:
    """None fields: the schemas are valid; else the 400's message and parameter."""

    message: str | None = None
    param: str | None = None


VALID = Verdict()


def request_schemas(call: CompletionCall, prefix: str = "") -> list[tuple[str, str]]:
    """The schemas ``call`` carries, as ``(parameter, the compact JSON text they came in)``:
    ``response_format``'s worker text and the tools' list (``prefix``: the native invoke
    route's ``params.``)."""
    out = []
    response_format = call.params.response_format
    if response_format is not None and '"schema"' in response_format:
        out.append((f"{prefix}response_format.json_schema.schema", response_format))
    if call.tools is not None and '"parameters"' in call.tools:
        out.append((f"{prefix}tools", call.tools))
    return out


def check_texts(texts: list[tuple[str, str]]) -> Verdict:
    """The verdict on ``texts`` (see :func:`request_schemas`); runs in the checker process."""
    from hotpool.platform.response_format import check_schema

    for param, text in texts:
        value = json.loads(text)
        if isinstance(value, list):  # the tools
            pairs = [
                (f"{param}[{i}].function.parameters", tool["function"]["parameters"])
                for i, tool in enumerate(value)
                if "parameters" in tool["function"]
            ]
        else:
            pairs = [(param, value["schema"])]
        for where, schema in pairs:
            try:
                check_schema(schema, where)
            except APIError as exc:
                return Verdict(exc.message, exc.param)
    return VALID


class SchemaChecker:
    """Verdicts on requests' schemas: remembered, or made in a process of their own."""

    def __init__(
        self,
        per_tenant: int = PER_TENANT,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
        check_timeout_s: float = CHECK_TIMEOUT_S,
    ) -> None:
        self.per_tenant = per_tenant
        self.queue_timeout_s = queue_timeout_s
        self.check_timeout_s = check_timeout_s
        self._verdicts: OrderedDict[bytes, Verdict] = OrderedDict()
        self._slots: dict[int, asyncio.Semaphore] = {}
        self._pool: ProcessPoolExecutor | None = None
        self.checked = 0  # verdicts made in the process (not remembered ones)

    async def check(self, tenant_id: int, call: CompletionCall, prefix: str = "") -> None:
        """Nothing if the schemas ``call`` carries are valid; else the 400 naming where."""
        texts = request_schemas(call, prefix)
        if not texts:
            return
        digest = hashlib.sha256()
        for param, text in texts:
            digest.update(b"%d:%s\0%s\0" % (len(text), param.encode(), text.encode()))
        key = digest.digest()
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = await self._check(tenant_id, texts)
            self._verdicts[key] = verdict
            while len(self._verdicts) > VERDICTS:
                self._verdicts.popitem(last=False)
        else:
            self._verdicts.move_to_end(key)
        if verdict.message is not None:
            raise invalid(verdict.message, verdict.param)

    async def _check(self, tenant_id: int, texts: list[tuple[str, str]]) -> Verdict:
        slots = self._slots.setdefault(tenant_id, asyncio.Semaphore(self.per_tenant))
        try:
            await asyncio.wait_for(slots.acquire(), self.queue_timeout_s)
        except TimeoutError:
            raise APIError(
                429,
                f"more than {self.per_tenant} requests of this tenant have new JSON Schemas "
                "being checked; retry shortly (a schema already seen is not checked again)",
                code="rate_limit_exceeded",
                retry_after_s=1,
            ) from None
        try:
            future = asyncio.get_running_loop().run_in_executor(
                self._executor(), check_texts, texts
            )
        except BrokenProcessPool:  # known dead before this check was sent
            slots.release()
            raise self._restarted() from None
        # The slot is the tenant's until the check ends, not until this request stops
        # waiting: a client that gives up or times out cannot stack checks up.
        future.add_done_callback(lambda _: slots.release())
        try:
            verdict = await asyncio.wait_for(asyncio.shield(future), self.check_timeout_s)
        except BrokenProcessPool:  # the checker died (killed, out of memory)
            raise self._restarted() from None
        except TimeoutError:  # not remembered: a busy machine is not the schema's fault
            raise invalid(
                f"checking this request's JSON Schema took longer than "
                f"{self.check_timeout_s:g} s; send a smaller or simpler schema",
                texts[0][0],
            ) from None
        self.checked += 1
        return verdict

    def _restarted(self) -> APIError:
        """The checker process died: the next check starts a new one."""
        self._pool = None
        return APIError(
            503, "the JSON Schema checker restarted; retry", code="schema_checker_restarted",
            retry_after_s=1,
        )  # fmt: skip

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the control plane has threads, which a forked child must not inherit
            context = multiprocessing.get_context("spawn")
            # at a lower priority: on a small machine it shares cores with the workers,
            # whose decode steps every tenant's stream waits on
            self._pool = ProcessPoolExecutor(
                PROCESSES, mp_context=context, initializer=os.nice, initargs=(NICENESS,)
            )
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
