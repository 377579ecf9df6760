"""Many generations on one connection (``POST /generate/mux``): the control plane's client
(``WorkerMuxes``) against a real worker app with SmolLM2 loaded, served by uvicorn on a
loopback port."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn_thread import uvicorn_in_thread

from hotpool.http_protocol import HeadCorkedHttpToolsProtocol
from hotpool.platform.worker_mux import WorkerMuxes, WorkerRefused
from hotpool.worker import mux as worker_mux_server
from hotpool.worker.engine.llm_engine import EngineConfig
from hotpool.worker.protocol import GenerateEvent, GenerateRequest, LoadRequest, SamplingParams
from hotpool.worker.server import build_worker_app
from hotpool.worker.service import WorkerService
from hotpool.worker.snapshot.cache import SnapshotCache

TOKEN = "mux-token"
LONG = 1000  # tokens: many seconds of generation on any CPU
QUICKLY = 3.0  # seconds: an abort lands well within this


@dataclass
class Worker:
    url: str
    service: WorkerService
    connections: list[Any] = field(default_factory=list)  # the client address of each mux
    stopping: bool = False

    def idle(self) -> bool:
        loaded = self.service.loaded
        return loaded is not None and loaded.engine.num_active == 0

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            assert time.monotonic() < deadline, "the worker's engine still runs requests"
            time.sleep(0.02)

    async def idle_soon(self, timeout_s: float = QUICKLY) -> None:
        """Idle within ``timeout_s``, with the control plane's connection still open."""
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            assert time.monotonic() < deadline, "the worker's engine still runs requests"
            await asyncio.sleep(0.02)


class _CountMuxes:
    def __init__(self, app: ASGIApp, seen: list[Any]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/generate/mux":
            self.seen.append(scope["client"])
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, smollm2_snapshot_bf16: Path
) -> Iterator[Worker]:
    service = WorkerService(
        SnapshotCache(tmp_path_factory.mktemp("cache")),
        torch.device("cpu"),
        EngineConfig(kv_cache_bytes=64 << 20),
    )
    asyncio.run(service.load(LoadRequest("d", f"file://{smollm2_snapshot_bf16}")))
    holder = Worker("", service)
    app = _CountMuxes(
        build_worker_app(service, TOKEN, "w-mux", lambda: holder.stopping), holder.connections
    )
    try:
        with uvicorn_in_thread(app, http=HeadCorkedHttpToolsProtocol) as url:
            holder.url = url
            yield holder
    finally:
        asyncio.run(service.unload())


def _request(rid: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, params, prompt=prompt).to_json()


async def _run(muxes: WorkerMuxes, url: str, rid: str, prompt: str, n: int) -> list[GenerateEvent]:
    async with muxes.generate(url, rid, _request(rid, prompt, n)) as stream:
        return [e async for e in stream]


def run(scenario: Callable[[WorkerMuxes], Any]) -> Any:
    async def main() -> Any:
        muxes = WorkerMuxes(TOKEN)
        try:
            return await asyncio.wait_for(scenario(muxes), 60)
        finally:
            await muxes.aclose()

    return asyncio.run(main())


def test_concurrent_generations_share_one_connection_each_with_its_own_events(
    worker: Worker,
) -> None:
    prompts = ["One two three", "The sky is", "def f(x):", "Paris is", "Hello", "1, 2, 3,"]
    before = len(worker.connections)

    async def scenario(muxes: WorkerMuxes) -> list[list[GenerateEvent]]:
        return await asyncio.gather(
            *(_run(muxes, worker.url, f"m{i}", p, 6 + i) for i, p in enumerate(prompts))
        )

    streams = run(scenario)
    assert len(worker.connections) == before + 1  # one exchange carried all six
    for i, events in enumerate(streams):
        finishes = [e.finish_reason for e in events if e.finish_reason]
        assert finishes == ["length"]
        assert sum(len(e.token_ids) for e in events) == 6 + i
        assert events[-1].usage is not None and events[-1].usage.completion_tokens == 6 + i
    worker.wait_idle()


def test_a_refused_request_fails_before_any_event_and_the_others_run_on(worker: Worker) -> None:
    async def scenario(muxes: WorkerMuxes) -> tuple[list[GenerateEvent], BaseException]:
        good = asyncio.ensure_future(_run(muxes, worker.url, "ok", "Count: one,", 8))
        too_long = _request("long", "word " * 5000, 4)  # more than the KV cache holds
        with pytest.raises(WorkerRefused) as refused:
            async with muxes.generate(worker.url, "long", too_long) as stream:
                await anext(stream)
        return await good, refused.value

    events, refused = run(scenario)
    assert isinstance(refused, WorkerRefused) and refused.status == 400
    assert "KV cache" in refused.message
    assert sum(len(e.token_ids) for e in events) == 8


def test_leaving_a_stream_early_aborts_it_on_the_worker(worker: Worker) -> None:
    async def scenario(muxes: WorkerMuxes) -> int:
        async with muxes.generate(worker.url, "early", _request("early", "Once", LONG)) as s:
            got = [await anext(s), await anext(s)]
        await worker.idle_soon()  # long before the generation could have run to its end
        # The exchange is still good for the next one.
        after = await _run(muxes, worker.url, "next", "Twice", 3)
        return len(got) + len(after)

    assert run(scenario) > 2


def test_a_lost_connection_fails_its_streams_and_the_next_request_reconnects(
    worker: Worker,
) -> None:
    async def scenario(muxes: WorkerMuxes) -> list[GenerateEvent]:
        async with muxes.generate(worker.url, "cut", _request("cut", "Once upon", LONG)) as s:
            await anext(s)
            (mux,) = muxes._muxes.values()
            assert mux._writer is not None
            mux._writer.transport.abort()  # the connection breaks under it
            with pytest.raises(httpx.TransportError):
                async for _ in s:
                    pass
        await worker.idle_soon()  # the worker aborted what the lost connection was running
        return await _run(muxes, worker.url, "again", "Once upon", 3)

    before = len(worker.connections)
    events = run(scenario)
    assert sum(len(e.token_ids) for e in events) == 3
    assert len(worker.connections) == before + 2


def test_a_stopping_worker_refuses_new_work_with_503_and_ends_the_exchange(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An idle exchange looks at `stopping` when woken, or every STOP_POLL_S: here only the
    # refusal of "after" can wake it, so "after" is sure to reach it first.
    monkeypatch.setattr(worker_mux_server, "STOP_POLL_S", 60.0)

    async def scenario(muxes: WorkerMuxes) -> tuple[int, bool]:
        await _run(muxes, worker.url, "before", "Hi", 2)  # an exchange is open
        (mux,) = muxes._muxes.values()
        # The client has the end frame just before the worker's exchange looks at
        # `stopping` once more (when it forgets "before"): let that look find it false.
        await worker.idle_soon()
        await asyncio.sleep(0.05)
        worker.stopping = True
        try:
            with pytest.raises(WorkerRefused) as refused:
                await _run(muxes, worker.url, "after", "Hi", 2)
            for _ in range(100):  # idle and stopping: the worker ends the exchange
                if mux.closed:
                    break
                await asyncio.sleep(0.05)
            return refused.value.status, mux.closed
        finally:
            worker.stopping = False

    assert run(scenario) == (503, True)


def test_the_wrong_token_is_a_connect_time_error(worker: Worker) -> None:
    async def scenario(_: WorkerMuxes) -> None:
        wrong = WorkerMuxes("nope")
        try:
            with pytest.raises(httpx.RemoteProtocolError, match="401"):
                await _run(wrong, worker.url, "x", "Hi", 2)
        finally:
            await wrong.aclose()

    run(scenario)
