"""The warm pool's bookkeeping, with start/stop callables standing in for worker processes
(tests/e2e/test_warm_pool.py runs it with real ones)."""

from __future__ import annotations

import asyncio

import pytest

from hotpool.pool.backend import WorkerHandle
from hotpool.pool.warm import IdleWorker, IdleWorkers, WarmPool
from hotpool.worker.protocol import WorkerInfo


def _worker(worker_id: str, last: str | None = None) -> IdleWorker:
    info = WorkerInfo(worker_id, "http://127.0.0.1:1", 1, "cpu", 1)
    return IdleWorker(WorkerHandle(worker_id), info, last)


def test_idle_set_is_lru_and_prefers_the_worker_that_served_the_deployment() -> None:
    idle = IdleWorkers(limit=2)
    assert idle.add(_worker("a", "x")) == [] and idle.add(_worker("b", "y")) == []
    (over,) = idle.add(_worker("c", "z"))
    assert over.handle.worker_id == "a"  # the oldest goes first
    taken = idle.take("z")
    assert taken is not None and taken.handle.worker_id == "c"  # its RAM may hold z
    other = idle.take("unknown")
    assert other is not None and other.handle.worker_id == "b"  # else the oldest
    assert idle.take("x") is None and len(idle) == 0


def test_reap_drops_dead_workers() -> None:
    idle = IdleWorkers(limit=3)
    for w in ("a", "b", "c"):
        idle.add(_worker(w))
    dead = idle.reap(lambda h: "exited 9" if h.worker_id == "b" else None)
    assert [w.handle.worker_id for w in dead] == ["b"]
    assert [w.handle.worker_id for w in idle.all()] == ["a", "c"]


class Processes:
    """Start/stop callables that record what the pool asked for."""

    def __init__(self, fail: bool = False) -> None:
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.fail = fail

    async def start(self, worker_id: str) -> tuple[WorkerHandle, WorkerInfo]:
        await asyncio.sleep(0)
        self.started.append(worker_id)
        if self.fail:
            raise RuntimeError("no such binary")
        return WorkerHandle(worker_id), _worker(worker_id).info

    async def stop(self, handle: WorkerHandle) -> None:
        self.stopped.append(handle.worker_id)


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_refill_offer_claim_and_close() -> None:
    async def scenario() -> None:
        procs = Processes()
        room = {"free": 5}
        pool = WarmPool(2, procs.start, procs.stop, lambda: room["free"] > 0)
        pool.refill()
        await _settle()
        assert len(procs.started) == 2 and len(pool.idle) == 2
        claimed = pool.claim("d")
        assert isinstance(claimed, IdleWorker)
        pool.refill()
        await _settle()
        assert len(procs.started) == 3 and len(pool.idle) == 2  # refilled
        pool.offer(IdleWorker(claimed.handle, claimed.info, "d"))  # released replica's worker
        await _settle()
        assert len(pool.idle) == 2 and len(procs.stopped) == 1  # the oldest made room
        again = pool.claim("d")
        assert again is not None and again.handle.worker_id == claimed.handle.worker_id
        await pool.close()
        assert set(procs.stopped) >= {w.handle.worker_id for w in pool.idle.all()}

    asyncio.run(scenario())


def test_no_room_means_no_new_process() -> None:
    async def scenario() -> None:
        procs = Processes()
        pool = WarmPool(3, procs.start, procs.stop, lambda: False)
        pool.refill()
        await _settle()
        assert procs.started == [] and pool.claim("d") is None

    asyncio.run(scenario())


def test_failed_starts_back_off_instead_of_spinning(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        procs = Processes(fail=True)
        pool = WarmPool(1, procs.start, procs.stop, lambda: True)
        pool.refill()
        await _settle()
        for _ in range(5):  # the autoscaler ticks: no retry before the backoff ends
            pool.refill()
            await _settle()
        assert len(procs.started) == 1 and len(pool) == 0
        await pool.close()

    asyncio.run(scenario())
    assert "failed to start" in caplog.text
