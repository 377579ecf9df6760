"""Requests' JSON Schemas are checked in a process of their own, remembered by digest, at most
a few at once per tenant and within a deadline (hotpool.platform.schema_checks)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hotpool.platform.errors import APIError
from hotpool.platform.invoke_api import parse_invoke
from hotpool.platform.response_format import MAX_SCHEMA_BYTES
from hotpool.platform.schema_checks import SchemaChecker
from hotpool.platform.schemas import CompletionCall, parse_chat

USER = [{"role": "user", "content": "JSON please"}]


def _chat(schema: Any) -> CompletionCall:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return parse_chat({"model": "m", "messages": USER, "response_format": fmt})


def _big(tag: str, properties: int = 2000) -> dict[str, Any]:
    """A valid schema that takes a while to check (a second or so at 2,000 properties,
    the size limit is about 7,000), distinct per ``tag`` (so never remembered)."""
    props = {f"{tag}_{i}": {"type": "integer"} for i in range(properties)}
    return {"type": "object", "properties": props}


@pytest.fixture
def checker() -> Iterator[SchemaChecker]:
    checker = SchemaChecker()
    yield checker
    checker.close()


def test_a_bad_schema_is_a_400_naming_where_and_each_verdict_is_made_once(
    checker: SchemaChecker,
) -> None:
    bad = _chat({"type": "object", "properties": {"a": {"type": "strin"}}})
    good = _chat({"type": "object", "properties": {"a": {"type": "string"}}})

    async def run() -> None:
        for _ in range(3):
            with pytest.raises(APIError) as info:
                await checker.check(1, bad)
            assert info.value.status == 400
            assert info.value.param == "response_format.json_schema.schema"
            where = "`response_format.json_schema.schema.properties.a.type` is not a valid"
            assert info.value.message.startswith(where)
            await checker.check(1, good)
        assert checker.checked == 2  # the other four were remembered
        # The native route names its fields under `params.`.
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}
        call = parse_invoke({"prompt": "x", "params": {"response_format": fmt}}, "m")
        with pytest.raises(APIError) as info:
            await checker.check(1, call, prefix="params.")
        assert info.value.message.startswith("`params.response_format.json_schema.schema.type`")

    asyncio.run(run())


def test_a_tools_parameters_schema_is_checked_and_named_by_its_tool(
    checker: SchemaChecker,
) -> None:
    tools = [
        {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "f", "parameters": {"required": "a"}}},
    ]
    call = parse_chat({"model": "m", "messages": USER, "tools": tools})
    with pytest.raises(APIError) as info:
        asyncio.run(checker.check(1, call))
    assert info.value.param == "tools[1].function.parameters"
    assert info.value.message.startswith("`tools[1].function.parameters.required` is not")


def test_a_schema_over_the_size_limit_is_refused_before_it_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sized before the check, which grows with it (a 3 MB schema: a minute of checking):
    parsing the request refuses it, and nothing checks it."""

    def checked(*_: object) -> None:
        raise AssertionError("the schema was checked")

    monkeypatch.setattr("hotpool.platform.response_format.check_schema", checked)
    with pytest.raises(APIError) as info:
        _chat(_big("p", 80_000))
    assert info.value.status == 400 and f"larger than {MAX_SCHEMA_BYTES} bytes" in str(info.value)


def test_one_tenants_checks_past_its_slots_wait_then_get_a_429_and_other_tenants_do_not(
) -> None:  # fmt: skip
    checker = SchemaChecker(per_tenant=1, queue_timeout_s=0.1)
    calls = [_chat(_big(f"t{i}")) for i in range(3)]
    assert all(len(json.dumps(c.params.response_format)) < MAX_SCHEMA_BYTES for c in calls)

    async def run() -> list[BaseException | None]:
        return await asyncio.gather(
            checker.check(1, calls[0]),
            checker.check(1, calls[1]),  # waits for tenant 1's only slot, past 0.1 s
            checker.check(2, calls[2]),  # another tenant: a slot of its own
            return_exceptions=True,
        )

    try:
        first, second, other = asyncio.run(run())
    finally:
        checker.close()
    assert first is None and other is None
    assert isinstance(second, APIError) and second.status == 429
    assert second.retry_after_s == 1 and second.code == "rate_limit_exceeded"


def test_a_check_past_its_deadline_is_a_400_that_is_not_remembered() -> None:
    checker = SchemaChecker(check_timeout_s=0.05)
    call = _chat(_big("slow"))

    async def run() -> None:
        with pytest.raises(APIError) as info:
            await checker.check(1, call)
        assert info.value.status == 400 and "took longer than 0.05 s" in info.value.message
        checker.check_timeout_s = 120.0
        await checker.check(1, call)  # checked again, and valid

    try:
        asyncio.run(run())
    finally:
        checker.close()


def test_the_event_loop_keeps_ticking_while_a_large_schema_is_checked(
    checker: SchemaChecker,
) -> None:
    """The loop's longest pause while a schema near the limit (seconds of checking) is checked:
    on the loop it was the whole check; here it is the hashing and the hand-off."""

    async def run() -> tuple[float, float]:
        await checker.check(1, _chat({"type": "object"}))  # the process is started
        check = asyncio.create_task(checker.check(1, _chat(_big("lag", 6000))))
        longest, t0 = 0.0, time.perf_counter()
        while not check.done():
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            longest = max(longest, time.perf_counter() - before)
        await check
        return longest, time.perf_counter() - t0

    longest, total = asyncio.run(run())
    assert longest < total / 4, (longest, total)


def test_a_checker_process_that_dies_is_a_503_then_replaced(checker: SchemaChecker) -> None:
    async def run() -> None:
        await checker.check(1, _chat({"type": "object"}))  # the process is up
        pool = checker._pool
        assert pool is not None
        for process in pool._processes.values():  # killed, as the OOM killer would
            os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(APIError) as info:
            await checker.check(1, _chat(_big("after-kill", 10)))
        assert info.value.status == 503 and info.value.retry_after_s == 1
        await checker.check(1, _chat(_big("again", 10)))  # a new process checks it

    asyncio.run(run())
