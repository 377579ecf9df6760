"""The in-flight journal: what a crashed process leaves is billed, and nothing else."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from hotpool.billing.ledger import UsageRecord
from hotpool.platform.inflight import RESTART_ERROR, InflightJournal, OpenRequest


def _open(journal: InflightJournal, request_id: str, started_at: float = 1000.0) -> None:
    journal.open(OpenRequest(request_id, "smollm2", "chat.completions", 1, 7, None, started_at))


def _lines(folder: Path) -> list[dict[str, object]]:
    return [json.loads(x) for p in folder.glob("inflight.*.jsonl") for x in p.read_text().split()]


def _crashed(folder: Path) -> list[UsageRecord]:
    """What the next process bills (the journal is abandoned, never closed)."""
    return InflightJournal(folder).recover()


def test_token_counts_are_journalled_every_n_tokens_not_every_token(tmp_path: Path) -> None:
    journal = InflightJournal(tmp_path, every_tokens=16, every_s=3600)
    journal.start()
    _open(journal, "r1")
    for n in range(1, 101):
        journal.progress("r1", 20, n, 4)
    assert [x["completion_tokens"] for x in _lines(tmp_path) if x["op"] == "tokens"] == [
        1, 17, 33, 49, 65, 81, 97
    ]  # fmt: skip
    [rec] = _crashed(tmp_path)
    assert (rec.status, rec.error) == ("partial", RESTART_ERROR)
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens) == (20, 97, 4)


def test_a_crash_at_the_first_token_bills_the_whole_prompt(tmp_path: Path) -> None:
    """Issue 46: a request killed at its first token was billed 0 + 0 for a 6,423-token
    prompt, its first tokens line being 16 tokens or a second away."""
    journal = InflightJournal(tmp_path, every_tokens=16, every_s=3600)
    journal.start()
    _open(journal, "r1")
    journal.progress("r1", 6423, 1, 6000)
    [rec] = _crashed(tmp_path)
    assert (rec.status, rec.error) == ("partial", RESTART_ERROR)
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens) == (6423, 1, 6000)
    assert (rec.api_key_id, rec.deployment, rec.endpoint) == (7, "smollm2", "chat.completions")


def test_a_slow_stream_is_journalled_every_second(tmp_path: Path) -> None:
    journal = InflightJournal(tmp_path, every_tokens=1000, every_s=0.0)
    journal.start()
    _open(journal, "r1")
    journal.progress("r1", 5, 1, 0)
    journal.progress("r1", 5, 1, 0)  # no new token: nothing to write
    journal.progress("r1", 5, 2, 0)
    assert [x["completion_tokens"] for x in _lines(tmp_path) if x["op"] == "tokens"] == [1, 2]


def test_an_ended_request_is_billed_with_its_record_a_done_one_not_at_all(
    tmp_path: Path,
) -> None:
    journal = InflightJournal(tmp_path)
    journal.start()
    _open(journal, "ended")
    _open(journal, "done")
    record = UsageRecord("ended", "smollm2", "chat.completions", "completed", 12, 30)
    journal.end(record, created_at=1234.5)
    journal.end(UsageRecord("done", "smollm2", "chat.completions", "cancelled", 3, 1), 1.0)
    journal.done(["done"])
    [rec] = _crashed(tmp_path)
    assert rec.request_id == "ended" and rec.status == "completed"
    assert rec.completion_tokens == 30 and rec.created_at is not None
    assert rec.created_at.timestamp() == 1234.5


def test_compaction_keeps_only_live_requests(tmp_path: Path) -> None:
    journal = InflightJournal(tmp_path, every_tokens=1, compact_after=100)
    journal.start()
    _open(journal, "live")
    journal.progress("live", 9, 3, 0)
    for i in range(60):
        _open(journal, f"r{i}")
        journal.end(UsageRecord(f"r{i}", "smollm2", "completions", "completed", 1, 1), 1.0)
        journal.done([f"r{i}"])
    retired = journal.compact_if_due()
    assert retired is not None
    journal.sync(retired)
    [current] = tmp_path.glob("inflight.*.jsonl")
    assert current != retired and not retired.exists()
    assert [x["op"] for x in _lines(tmp_path)] == ["open", "tokens"]
    [rec] = _crashed(tmp_path)
    assert (rec.request_id, rec.completion_tokens) == ("live", 3)


def test_a_journal_is_dropped_only_once_the_next_process_starts_its_own(
    tmp_path: Path,
) -> None:
    first = InflightJournal(tmp_path)
    first.start()
    _open(first, "a")
    # The next process crashes too before it has billed "a": the one after still finds it.
    assert [r.request_id for r in InflightJournal(tmp_path).recover()] == ["a"]
    third = InflightJournal(tmp_path)
    assert [r.request_id for r in third.recover()] == ["a"]
    third.start()  # the caller has made "a" safe: its file goes
    _open(third, "b")
    assert [r.request_id for r in _crashed(tmp_path)] == ["b"]


def test_a_torn_journal_line_is_skipped(tmp_path: Path) -> None:
    journal = InflightJournal(tmp_path)
    journal.start()
    _open(journal, "a")
    [path] = tmp_path.glob("inflight.*.jsonl")
    with open(path, "ab") as f:
        f.write(b'{"op":"tokens","request_id":"a","prompt_tok')
    [rec] = _crashed(tmp_path)
    assert (rec.request_id, rec.completion_tokens, rec.status) == ("a", 0, "error")


def test_a_clean_close_with_nothing_in_flight_leaves_no_journal(tmp_path: Path) -> None:
    journal = InflightJournal(tmp_path)
    journal.start()
    _open(journal, "a")
    journal.end(UsageRecord("a", "smollm2", "completions", "completed", 1, 1), 1.0)
    journal.done(["a"])
    journal.close()
    assert list(tmp_path.iterdir()) == []


def test_on_the_event_loop_a_pass_is_written_at_its_end_in_order(tmp_path: Path) -> None:
    """A burst admitted in one pass of the loop is journalled after it, in one write; what
    follows in the next pass lands after it, and a crash then finds every line."""
    journal = InflightJournal(tmp_path, every_tokens=1)
    journal.start()
    [path] = tmp_path.glob("inflight.*.jsonl")

    async def burst() -> list[int]:
        sizes = []
        for i in range(3):
            _open(journal, f"r{i}")
        sizes.append(path.stat().st_size)  # nothing yet: the pass is not over
        await asyncio.sleep(0)
        sizes.append(path.stat().st_size)
        journal.progress("r1", 5, 2, 0)
        journal.end(UsageRecord("r2", "smollm2", "completions", "completed", 5, 1), 1.0)
        await asyncio.sleep(0)
        return sizes

    sizes = asyncio.run(burst())
    assert sizes[0] == 0 and sizes[1] > 0
    assert [(x["op"], x.get("request_id")) for x in _lines(tmp_path)][:4] == [
        ("open", "r0"), ("open", "r1"), ("open", "r2"), ("tokens", "r1"),
    ]  # fmt: skip
    crashed = {r.request_id: r for r in _crashed(tmp_path)}
    assert crashed["r1"].completion_tokens == 2 and crashed["r1"].status == "partial"
    assert crashed["r2"].status == "completed" and crashed["r0"].status == "error"


def test_compaction_on_the_loop_writes_the_snapshot_before_the_old_file_goes(
    tmp_path: Path,
) -> None:
    """sync() removes the retired file from a thread right after compaction: the live
    requests must already be in the new file then, not waiting for the end of the pass."""
    journal = InflightJournal(tmp_path, every_tokens=1, compact_after=10)
    journal.start()

    async def compact() -> None:
        _open(journal, "live")
        journal.progress("live", 9, 3, 0)
        for i in range(10):
            _open(journal, f"r{i}")
            journal.done([f"r{i}"])
        retired = journal.compact_if_due()  # pending lines of this pass included
        assert retired is not None
        journal.sync(retired)  # as the thread may, before this pass ends
        assert not retired.exists()
        [rec] = _crashed(tmp_path)  # before this pass ends
        assert (rec.request_id, rec.completion_tokens) == ("live", 3)

    asyncio.run(compact())


def test_on_the_event_loop_a_first_token_is_on_disk_before_it_can_reach_the_client(
    tmp_path: Path,
) -> None:
    """The invoker journals a token, then sends it to the client in the same pass: a kill -9
    right after the client has the first token must find the prompt's count (a CI run lost
    it when the first tokens line waited for the end of the pass). Later lines still wait."""
    journal = InflightJournal(tmp_path, every_tokens=2, every_s=3600)
    journal.start()

    async def stream() -> list[list[str]]:
        _open(journal, "r1")  # admitted in an earlier pass
        await asyncio.sleep(0)
        seen = []
        journal.progress("r1", 6423, 1, 0)  # the first token, about to be sent
        seen.append([str(x["op"]) for x in _lines(tmp_path)])
        journal.progress("r1", 6423, 3, 0)  # a later line: at the end of the pass
        seen.append([str(x["op"]) for x in _lines(tmp_path)])
        await asyncio.sleep(0)
        seen.append([str(x["op"]) for x in _lines(tmp_path)])
        return seen

    assert asyncio.run(stream()) == [
        ["open", "tokens"], ["open", "tokens"], ["open", "tokens", "tokens"]
    ]  # fmt: skip
    [rec] = _crashed(tmp_path)
    assert (rec.prompt_tokens, rec.completion_tokens) == (6423, 3)
