"""Cache-aware vs least-loaded routing: two replicas, three workloads, one run.

A real ``hotpool serve`` (control plane + two local worker processes, SmolLM2-135M fp32 on
the CPU, one thread each) serves a deployment of exactly two replicas, first with
``HOTPOOL_ROUTING=least_loaded``, then with ``cache_aware`` (a fresh server each, the same
requests in the same order). Each replica's KV cache is ``--kv-mib`` MiB: room for about
half of a workload's distinct prefixes, as a real fleet's working set is larger than one
replica's cache (with room for everything on every replica, least-loaded routing would
miss only on each prefix's first visit to each replica).

Workloads, each with prompts of its own (nothing carries over between them):

  shared_prefix  ``--apps`` long system prompts (an "app" each, ~``--prefix-tokens``
                 tokens) with short user questions; ``--clients`` closed-loop clients pick
                 an app at random (seeded) for each of ``--requests`` chat requests.
  multi_turn     ``--conversations`` chats of ``--turns`` turns: each turn sends the whole
                 history (the replies the model gave) and a new question; a client runs its
                 conversations' turns in order, round-robin over them.
  no_shared      ``--requests`` prompts that share nothing (random words), the control:
                 cache-aware routing must cost nothing here.

Per workload and routing: prompt tokens served from cache (the usage's ``cached_tokens``
over ``prompt_tokens``), TTFT p50/p95 (the first chunk with text, streamed) and output
tokens/s over the workload's wall time; then least-loaded / cache-aware TTFT p50 and p95,
and cache-aware / least-loaded throughput. **Targets: TTFT p50 >= 1.5x better on
shared_prefix, >= 0.95x on no_shared.**

    python benchmarks/bench_routing.py
    python benchmarks/bench_routing.py --requests 96 --clients 6 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from serve_process import pct, serve, smollm2_snapshot, wait_for  # benchmarks/ is the script folder

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "bench"
NAME = "routed"
WORDS = [
    "river",
    "stone",
    "market",
    "lantern",
    "orchard",
    "harbor",
    "copper",
    "meadow",
    "violin",
    "glacier",
    "compass",
    "ember",
    "falcon",
    "thistle",
    "quarry",
    "saddle",
    "beacon",
    "willow",
    "anchor",
    "prism",
    "tundra",
    "mosaic",
    "cobalt",
    "juniper",
    "canyon",
    "ribbon",
    "parsley",
    "walnut",
    "signal",
    "ferry",
    "cedar",
    "marble",
    "pepper",
    "summit",
    "velvet",
    "drizzle",
]


@dataclass
class Result:
    workload: str
    ttft: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat(client: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int) -> Result:
    body = {
        "model": NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = Result("")
    t0 = time.monotonic()
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res
            parts = []
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text and res.ttft is None:
                        res.ttft = time.monotonic() - t0
                    parts.append(text)
                if u := chunk.get("usage"):
                    res.prompt_tokens = int(u["prompt_tokens"])
                    res.completion_tokens = int(u["completion_tokens"])
                    res.cached_tokens = int(
                        (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    )
            res.text = "".join(parts)
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    if res.error is None and res.ttft is None:
        res.error = "no text came back"
    return res


# --- workloads: each a list of client scripts; a script yields the next request's messages,
# given the previous reply -------------------------------------------------------------------

Script = Callable[[], Iterator[list[dict[str, str]]]]


def shared_prefix(args: argparse.Namespace) -> list[Script]:
    rng = random.Random(1)
    apps = [
        f"You are assistant number {i} of the Acme help desk. Policies: "
        + words(rng, int(args.prefix_tokens * 0.9))
        for i in range(args.apps)
    ]
    picks = [(rng.randrange(args.apps), words(rng, 8)) for _ in range(args.requests)]
    per_client = [picks[c :: args.clients] for c in range(args.clients)]

    def script(mine: list[tuple[int, str]]) -> Script:
        def run() -> Iterator[list[dict[str, str]]]:
            for app, question in mine:
                yield [
                    {"role": "system", "content": apps[app]},
                    {"role": "user", "content": question + "?"},
                ]

        return run

    return [script(m) for m in per_client]


def multi_turn(args: argparse.Namespace) -> list[Script]:
    rng = random.Random(2)
    convs = [
        [words(rng, int(args.prefix_tokens * 0.6))]
        + [words(rng, 12) for _ in range(args.turns - 1)]
        for _ in range(args.conversations)
    ]
    per_client = [list(range(c, args.conversations, args.clients)) for c in range(args.clients)]

    def script(mine: list[int]) -> Script:
        def run() -> Iterator[list[dict[str, str]]]:
            history: dict[int, list[dict[str, str]]] = {c: [] for c in mine}
            for turn in range(args.turns):
                for c in mine:
                    history[c].append({"role": "user", "content": convs[c][turn]})
                    reply = yield list(history[c])
                    history[c].append({"role": "assistant", "content": reply or "ok"})

        return run

    return [script(m) for m in per_client]


def no_shared(args: argparse.Namespace) -> list[Script]:
    rng = random.Random(3)
    prompts = [f"{i}: " + words(rng, int(args.prefix_tokens * 0.9)) for i in range(args.requests)]
    per_client = [prompts[c :: args.clients] for c in range(args.clients)]

    def script(mine: list[str]) -> Script:
        def run() -> Iterator[list[dict[str, str]]]:
            for p in mine:
                yield [{"role": "user", "content": p}]

        return run

    return [script(m) for m in per_client]


WORKLOADS = {"shared_prefix": shared_prefix, "multi_turn": multi_turn, "no_shared": no_shared}


def run_workload(url: str, name: str, scripts: list[Script], max_tokens: int) -> dict[str, Any]:
    results: list[Result] = []
    lock = threading.Lock()

    def client(script: Script) -> None:
        gen = script()
        with httpx.Client(timeout=600) as http:
            reply = None
            try:
                messages = next(gen)
                while True:
                    res = chat(http, url, messages, max_tokens)
                    res.workload = name
                    with lock:
                        results.append(res)
                    reply = res.text
                    messages = gen.send(reply)
            except StopIteration:
                return

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in scripts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": [r.error for r in results if r.error is not None][:5],
        "cached_ratio": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p95": pct(ttfts, 0.95),
        "tok_s": sum(r.completion_tokens for r in ok) / wall,
        "wall_s": wall,
    }


@contextlib.contextmanager
def server(routing: str, args: argparse.Namespace) -> Iterator[str]:
    home = CACHE / "routing" / routing
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    env = {
        "HOTPOOL_ROUTING": routing,
        "HOTPOOL_MAX_WORKERS": "2",
        "HOTPOOL_WARM_WORKERS": "0",
        "HOTPOOL_WORKER_THREADS": str(args.threads),
    }
    with serve(home, env) as (url, _):
        yield url


def deploy(url: str, uri: str, args: argparse.Namespace) -> None:
    body = {
        "name": NAME,
        "snapshot_uri": uri,
        "min_replicas": 2,
        "max_replicas": 2,
        "target_concurrency": args.target_concurrency,
        "dtype": "fp32",
        "kv_cache_bytes": args.kv_mib << 20,
        "idle_timeout_s": 3600,
    }
    r = httpx.post(url + "/v1/deployments", json=body, timeout=30)
    if r.status_code != 201:
        raise RuntimeError(f"deploy: HTTP {r.status_code} {r.text}")

    def ready() -> bool:
        reps = httpx.get(f"{url}/v1/deployments/{NAME}", timeout=10).json()["replicas"]
        return sum(x["state"] == "ready" for x in reps) == 2

    wait_for("two ready replicas", ready, 600)
    time.sleep(3)  # a heartbeat from each (their block size), before the first request


def snapshot() -> str:
    return smollm2_snapshot(CACHE, "fp32")


def fmt(v: float, digits: int = 2) -> str:
    return f"{v:.{digits}f}"


def report(out: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    print("\n| workload | routing | cached | TTFT p50 s | TTFT p95 s | tok/s | requests |")
    print("|---|---|---|---|---|---|---|")
    for w in WORKLOADS:
        for routing in ("least_loaded", "cache_aware"):
            m = out[routing][w]
            print(
                f"| {w} | {routing} | {m['cached_ratio']:.0%} | {fmt(m['ttft_p50'], 3)} | "
                f"{fmt(m['ttft_p95'], 3)} | {fmt(m['tok_s'], 1)} | {m['requests']} |"
            )
    ratios: dict[str, dict[str, float]] = {}
    print("\n| workload | TTFT p50 (ll / ca) | TTFT p95 (ll / ca) | tok/s (ca / ll) |")
    print("|---|---|---|---|")
    for w in WORKLOADS:
        ll, ca = out["least_loaded"][w], out["cache_aware"][w]
        ratios[w] = {
            "ttft_p50": ll["ttft_p50"] / ca["ttft_p50"],
            "ttft_p95": ll["ttft_p95"] / ca["ttft_p95"],
            "tok_s": ca["tok_s"] / ll["tok_s"],
        }
        r = ratios[w]
        print(f"| {w} | {fmt(r['ttft_p50'])}x | {fmt(r['ttft_p95'])}x | {fmt(r['tok_s'])}x |")
    targets = {
        "shared_prefix TTFT p50 >= 1.5x": ratios["shared_prefix"]["ttft_p50"] >= 1.5,
        "no_shared TTFT p50 >= 0.95x": ratios["no_shared"]["ttft_p50"] >= 0.95,
    }
    for what, met in targets.items():
        print(f"target {what}: {'MET' if met else 'NOT MET'}")
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=48, help="shared_prefix and no_shared requests")
    ap.add_argument("--clients", type=int, default=4, help="closed-loop clients per workload")
    ap.add_argument("--apps", type=int, default=8, help="shared_prefix's distinct system prompts")
    ap.add_argument(
        "--prefix-tokens", type=int, default=320, help="about the tokens of a long prompt"
    )
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-mib", type=int, default=96, help="each replica's KV cache")
    ap.add_argument("--target-concurrency", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per worker")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    uri = snapshot()
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for routing in ("least_loaded", "cache_aware"):
        print(f"[{routing}] starting hotpool serve", flush=True)
        with server(routing, args) as url:
            deploy(url, uri, args)
            out[routing] = {}
            for w, make in WORKLOADS.items():
                out[routing][w] = m = run_workload(url, w, make(args), args.max_tokens)
                print(f"[{routing}] {w}: {json.dumps(m)}", flush=True)
    ratios = report(out)
    failed = any(m["errors"] for r in out.values() for m in r.values())
    if args.json:
        Path(args.json).write_text(
            json.dumps({"results": out, "ratios": ratios, "args": vars(args)}, indent=2)
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
