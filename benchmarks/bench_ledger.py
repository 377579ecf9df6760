"""Ledger ingest on SQLite and PostgreSQL: hotpool's writer against one INSERT per event.

For each database (a SQLite file, and a fresh database on the PostgreSQL server of
``--postgres-url``), in one run:

  writer   the control plane's real path: ``LedgerWriter.submit`` on the request path, a
           queue, batches of up to 256 in one transaction each, with the spool folder and
           the in-flight journal on. Events/s from the first submit until every event is
           committed (``flush``).
  naive    the peer: one INSERT per event, one transaction each (``Ledger.record`` in a
           loop), as a tracker that writes on the request path does.
  replay   events spooled to disk (as during an outage) moved back into the database by the
           writer's replay: events/s.

On the request path it measures what ``submit`` costs (p50/p99 in microseconds), and what
the in-flight journal adds to one request: ``begin`` + a ``progress`` per token
(``--tokens``) + ``submit``, with the journal on and off. Prints a markdown table and one
JSON line; exits nonzero below ``--target`` events/s on any database.

    python benchmarks/bench_ledger.py
    python benchmarks/bench_ledger.py --events 50000 --skip-postgres
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from scratch_postgres import fresh_database
from sqlalchemy import func, select

from hotpool.billing.db import Database
from hotpool.billing.ledger import Ledger, UsageRecord
from hotpool.billing.models import UsageEvent
from hotpool.platform.inflight import OpenRequest
from hotpool.platform.ledger_writer import LedgerWriter
from hotpool.platform.spool import UsageSpool

DEFAULT_POSTGRES_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
DEPLOYMENTS = ("chat", "code", "embed", "smollm2")


def _records(prefix: str, n: int) -> list[UsageRecord]:
    return [
        UsageRecord(
            request_id=f"{prefix}-{i}",
            deployment=DEPLOYMENTS[i % len(DEPLOYMENTS)],
            endpoint="chat.completions",
            status="completed",
            prompt_tokens=100 + i % 50,
            completion_tokens=20 + i % 200,
            cached_tokens=i % 64,
            queue_seconds=0.001,
            ttft_seconds=0.05,
            total_seconds=0.8,
        )
        for i in range(n)
    ]


def _count(db: Database) -> int:
    with db.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(UsageEvent)).scalar_one())


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _writer_ingest(db: Database, spool: Path, n: int) -> dict[str, float]:
    """Events/s through the writer, and each submit's cost on the request path."""
    writer = LedgerWriter(Ledger(db), spool)
    await writer.start()
    recs = _records(f"w{uuid.uuid4().hex[:6]}", n)
    before = _count(db)
    costs: list[float] = []
    t0 = time.perf_counter()
    for i, rec in enumerate(recs):
        s = time.perf_counter_ns()
        writer.submit(rec)
        costs.append((time.perf_counter_ns() - s) / 1000)
        if i % 64 == 63:
            await asyncio.sleep(0)  # requests arrive over time: let the writer run between them
    await writer.flush()
    seconds = time.perf_counter() - t0
    await writer.close()
    assert _count(db) - before == n, "the writer lost or doubled events"
    return {
        "events_per_s": n / seconds,
        "seconds": seconds,
        "submit_p50_us": statistics.median(costs),
        "submit_p99_us": _pct(costs, 0.99),
    }


def _naive_ingest(db: Database, n: int) -> dict[str, float]:
    ledger = Ledger(db)
    recs = _records(f"n{uuid.uuid4().hex[:6]}", n)
    t0 = time.perf_counter()
    for rec in recs:
        ledger.record(rec)
    seconds = time.perf_counter() - t0
    return {"events_per_s": n / seconds, "seconds": seconds}


async def _replay(db: Database, spool: Path, n: int) -> dict[str, float]:
    recs = _records(f"r{uuid.uuid4().hex[:6]}", n)
    for i in range(0, n, 256):  # as the writer spools during an outage: a batch per append
        UsageSpool(spool).append(recs[i : i + 256])
    writer = LedgerWriter(Ledger(db), spool)
    t0 = time.perf_counter()
    assert await writer.replay()
    seconds = time.perf_counter() - t0
    assert writer.replayed == n
    return {"events_per_s": n / seconds, "seconds": seconds}


async def _request_path(spool: Path | None, requests: int, tokens: int) -> list[float]:
    """Microseconds per request of begin + a progress per token + submit."""
    db = Database("sqlite://")
    db.upgrade()
    writer = LedgerWriter(Ledger(db), spool)
    await writer.start()
    costs = []
    for i in range(requests):
        rid = f"q{i}"
        rec = UsageRecord(rid, "chat", "chat.completions", "completed", 100, tokens)
        t0 = time.perf_counter_ns()
        writer.begin(OpenRequest(rid, "chat", "chat.completions", 1, 3, None))
        for k in range(1, tokens + 1):
            writer.progress(rid, 100, k, 0)
        writer.submit(rec)
        costs.append((time.perf_counter_ns() - t0) / 1000)
        if i % 16 == 15:
            await asyncio.sleep(0)
    await writer.close()
    db.dispose()
    return costs


def _bench_db(name: str, url: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    print(f"[{name}] ingesting {args.events} events through the writer ...", flush=True)
    db = Database(url)
    db.upgrade()
    try:
        writer = asyncio.run(_writer_ingest(db, work / f"{name}-spool", args.events))
        print(f"[{name}] naive: {args.naive_events} events, one transaction each ...", flush=True)
        naive = _naive_ingest(db, args.naive_events)
        print(f"[{name}] replaying {args.events} spooled events ...", flush=True)
        replay = asyncio.run(_replay(db, work / f"{name}-replay", args.events))
    finally:
        db.dispose()
    return {"writer": writer, "naive": naive, "replay": replay}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=20_000)
    p.add_argument("--naive-events", type=int, default=2_000)
    p.add_argument("--requests", type=int, default=5_000, help="for the request-path cost")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--target", type=float, default=5_000.0, help="events/s each database")
    url = os.environ.get("HOTPOOL_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    p.add_argument("--postgres-url", default=url, help="a database used only to create one")
    p.add_argument("--skip-postgres", action="store_true")
    args = p.parse_args()

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        work = Path(tmp)
        results["sqlite"] = _bench_db("sqlite", f"sqlite:///{work / 'ledger.db'}", work, args)
        if not args.skip_postgres:
            with fresh_database(args.postgres_url, "hotpool_bench") as pg_url:
                results["postgresql"] = _bench_db("postgresql", pg_url, work, args)
        print(f"[request path] {args.requests} requests of {args.tokens} tokens ...", flush=True)
        on = asyncio.run(_request_path(work / "journal", args.requests, args.tokens))
        off = asyncio.run(_request_path(None, args.requests, args.tokens))

    journal = {
        "tokens_per_request": args.tokens,
        "with_journal_p50_us": statistics.median(on),
        "with_journal_p99_us": _pct(on, 0.99),
        "without_journal_p50_us": statistics.median(off),
        "without_journal_p99_us": _pct(off, 0.99),
    }
    journal["journal_cost_p50_us"] = (
        journal["with_journal_p50_us"] - journal["without_journal_p50_us"]
    )
    results["request_path"] = journal

    print()
    print("| database | path | events | seconds | events/s | vs naive |")
    print("|---|---|---:|---:|---:|---:|")
    ok = True
    for name in ("sqlite", "postgresql"):
        if name not in results:
            continue
        r = results[name]
        naive = r["naive"]["events_per_s"]
        for path, n in (
            ("writer", args.events),
            ("replay", args.events),
            ("naive", args.naive_events),
        ):
            x = r[path]
            print(
                f"| {name} | {path} | {n} | {x['seconds']:.2f} | {x['events_per_s']:,.0f} |"
                f" {x['events_per_s'] / naive:.1f}x |"
            )
        r["writer_vs_naive"] = r["writer"]["events_per_s"] / naive
        ok &= r["writer"]["events_per_s"] >= args.target
    print()
    print("| on the request path | p50 µs | p99 µs |")
    print("|---|---:|---:|")
    for name in ("sqlite", "postgresql"):
        if name in results:
            w = results[name]["writer"]
            print(
                f"| submit ({name} writer) | {w['submit_p50_us']:.1f} | {w['submit_p99_us']:.1f} |"
            )
    print(
        f"| request, journal on ({args.tokens} tokens) | {journal['with_journal_p50_us']:.1f} |"
        f" {journal['with_journal_p99_us']:.1f} |"
    )
    print(
        f"| request, journal off | {journal['without_journal_p50_us']:.1f} |"
        f" {journal['without_journal_p99_us']:.1f} |"
    )
    print(f"| the journal's cost per request | {journal['journal_cost_p50_us']:.1f} | |")
    print()
    print(json.dumps({"bench": "ledger", **results}))
    if not ok:
        print(f"below the target of {args.target:,.0f} events/s", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
