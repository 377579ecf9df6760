"""Scale-from-zero to first token for SmolLM2, by where the weights are, vs a naive baseline.

A warm worker (process up, torch imported, device initialised, no model) receives a load
request and then one generation; the clock runs from the load request to the first token:

  (a) remote: the snapshot only in S3 (a real S3 server over HTTP: moto, on loopback; moto
      reads a whole object for every ranged GET, so the bench fetches each file in one GET
      where real S3 and MinIO would use parallel 8 MiB ranges)
  (b) disk:   the snapshot in the worker's disk cache
  (c) host:   the weights still in the worker's host-memory tier from an earlier unload

The baseline, in the same run: a fresh process that imports transformers and runs
``from_pretrained`` on the same snapshot folder, then generates one token (what a naive
serverless handler does on every cold start). Each case runs ``--repeats`` times; the
table shows medians with the worker's phase breakdown.

    python benchmarks/bench_coldstart.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from hotpool.worker.host_cache import HostModelCache
from hotpool.worker.protocol import GenerateRequest, LoadRequest, SamplingParams
from hotpool.worker.service import WorkerService
from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.snapshot.pull import pull_smollm2
from hotpool.worker.snapshot.s3 import S3ObjectStore
from hotpool.worker.snapshot.store import ObjectStore, open_snapshot_uri, push_snapshot

REPO = Path(__file__).resolve().parent.parent
BUCKET = "hotpool-bench"
TARGETS = {"disk": 1.0, "host": 0.3}  # seconds, issue 5

BASELINE = """
import sys, time
t0 = time.perf_counter()
import torch, transformers
path = sys.argv[1]
tok = transformers.AutoTokenizer.from_pretrained(path)
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
ids = tok("Hello", return_tensors="pt")
with torch.inference_mode():
    model.generate(**ids, max_new_tokens=1, do_sample=False)
print(time.perf_counter() - t0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_s3() -> object:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    return server


def one_get_per_file(uri: str) -> tuple[ObjectStore, str]:
    store, prefix = open_snapshot_uri(uri)
    if isinstance(store, S3ObjectStore):
        config = replace(store.config, part_bytes=1 << 30)
        store = S3ObjectStore(store.bucket, config, client=store.client)  # the shared client
    return store, prefix


async def first_token(service: WorkerService, uri: str) -> tuple[float, dict[str, float], str]:
    t0 = time.perf_counter()
    result = await service.load(LoadRequest("bench", uri))
    req = GenerateRequest("r", SamplingParams(max_tokens=1, temperature=0.0), prompt="Hello")
    async for event in service.generate(req):
        if event.token_ids:
            break
    total = time.perf_counter() - t0
    phases = dict(result.phases, generate=total - sum(result.phases.values()))
    return total, phases, result.tier


def run_case(case: str, service: WorkerService, cache_root: Path, uri: str) -> tuple[float, ...]:
    """Bring the worker into the case's state, then time load -> first token."""
    asyncio.run(service.unload())  # (keeps the weights in the host tier)
    if case != "host":
        service.host_cache = HostModelCache(service.host_cache.budget_bytes)  # forget them
    if case == "remote":
        shutil.rmtree(cache_root, ignore_errors=True)
    total, phases, tier = asyncio.run(first_token(service, uri))
    assert tier == case, f"expected the {case} tier, the worker used {tier}"
    return total, phases  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-baseline", action="store_true")
    args = ap.parse_args()

    cache = REPO / ".cache" / "bench"
    local_uri, _ = pull_smollm2(
        f"file://{cache}/objects", "smollm2-bf16", "bf16", download_dir=cache / "downloads"
    )
    local = Path(local_uri.removeprefix("file://"))
    server = start_s3()
    uri = f"s3://{BUCKET}/snapshots/smollm2"
    push_snapshot(local, uri)

    work = Path(tempfile.mkdtemp(prefix="hotpool-coldstart-"))
    cache_root = work / "snapshots"
    service = WorkerService(
        SnapshotCache(cache_root, open_store=one_get_per_file),
        torch.device("cpu"),
        host_cache=HostModelCache(4 * 2**30),
    )
    asyncio.run(first_token(service, uri))  # warm the worker: kernels built, first-use costs

    print(f"SmolLM2-135M bf16, {torch.get_num_threads()} threads, median of {args.repeats}")
    header = f"{'case':<22} {'first token s':>13} | phases (s)"
    print(header)
    print("-" * 78)
    rows: dict[str, float] = {}
    for case in ("remote", "disk", "host"):
        runs = [run_case(case, service, cache_root, uri) for _ in range(args.repeats)]
        total = statistics.median(r[0] for r in runs)
        best = min(runs, key=lambda r: abs(r[0] - total))[1]
        rows[case] = total
        target = f" (target < {TARGETS[case]} s)" if case in TARGETS else ""
        detail = " ".join(f"{k} {v:.3f}" for k, v in best.items())  # type: ignore[attr-defined]
        print(f"{'(' + case[0] + ') ' + case:<22} {total:>13.3f} | {detail}{target}", flush=True)
    if not args.skip_baseline:
        times = []
        for _ in range(args.repeats):
            out = subprocess.run(
                [sys.executable, "-c", BASELINE, str(local)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            times.append(float(out.stdout.strip().splitlines()[-1]))
        base = statistics.median(times)
        print(f"{'baseline from_pretrained':<22} {base:>13.3f} | fresh process, HF transformers")
        for case, t in rows.items():
            print(f"  {case}: {base / t:.1f}x faster than the baseline")
    asyncio.run(service.unload())
    shutil.rmtree(work, ignore_errors=True)
    server.stop()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
