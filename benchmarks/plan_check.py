"""``bench_autoscale.py --plan-check``: the capacity planner's TTFT p95 against a measured run.

One replica (SmolLM2-135M fp32 on the CPU, every core) serves a deployment; first a
calibration load (8, 4, 2 and 1 concurrent streams of the workload's requests, largest
batches first) lets its engine measure its tokens/s by step size. Then the planner's model
(pool/planner.py), given that measured curve, predicts the largest request rate the
replica sustains, and at 30%, 50% and 70% of it the benchmark sends Poisson arrivals of
the same requests (each prompt distinct, so no prefix is cached) and measures their TTFT
p95 against the model's. **Target: predicted within 25% of measured at each of the three rates.**
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from serve_process import pct, serve, smollm2_snapshot, wait_for

from hotpool.pool.capacity import Rates
from hotpool.pool.planner import Workload, predict

NAME = "planned"
WORDS = (
    "amber",
    "birch",
    "cloud",
    "delta",
    "ember",
    "fjord",
    "grove",
    "harbor",
    "iris",
    "jade",
    "kelp",
    "lumen",
    "moss",
    "nectar",
)


def _prompt(rng: random.Random, words: int) -> str:
    return f"{rng.random():.6f} " + " ".join(rng.choice(WORDS) for _ in range(words))


def _one(url: str, prompt: str, max_tokens: int, out: list[dict[str, Any]]) -> None:
    body = {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    res: dict[str, Any] = {"ttft": None, "prompt_tokens": 0, "error": None}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("choices") and chunk["choices"][0].get("text") and res["ttft"] is None:
                    res["ttft"] = time.monotonic() - t0
                if u := chunk.get("usage"):
                    res["prompt_tokens"] = u["prompt_tokens"]
    except httpx.HTTPError as exc:
        res["error"] = repr(exc)
    out.append(res)


def _closed_loop(
    url: str, streams: int, requests: int, words: int, max_tokens: int, rng: random.Random
) -> None:
    prompts = [_prompt(rng, words) for _ in range(requests)]
    out: list[dict[str, Any]] = []

    def client(mine: list[str]) -> None:
        for p in mine:
            _one(url, p, max_tokens, out)

    threads = [threading.Thread(target=client, args=(prompts[i::streams],)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _poisson(
    url: str, rate: float, requests: int, words: int, max_tokens: int, rng: random.Random
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    threads = []
    t = time.monotonic()
    for _ in range(requests):
        t += rng.expovariate(rate)
        time.sleep(max(0.0, t - time.monotonic()))
        th = threading.Thread(target=_one, args=(url, _prompt(rng, words), max_tokens, out))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return out


def _max_rate(w: Workload, r: Rates) -> float:
    lo, hi = 0.0, 1000.0
    for _ in range(60):  # the largest rate the model keeps stable
        mid = (lo + hi) / 2
        if predict(Workload(mid, w.prompt_tokens, w.output_tokens), r).stable:
            lo = mid
        else:
            hi = mid
    return lo


def run_plan_check(args: argparse.Namespace, cache: Path) -> int:
    home = cache / "plan-check"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    uri = smollm2_snapshot(cache, "fp32")
    env = {"HOTPOOL_MAX_WORKERS": "1", "HOTPOOL_WARM_WORKERS": "0"}
    rng = random.Random(7)
    with serve(home, env) as (url, _):
        body = {"name": NAME, "snapshot_uri": uri, "min_replicas": 1, "max_replicas": 1,
                "target_concurrency": 64, "dtype": "fp32", "idle_timeout_s": 3600}  # fmt: skip
        r = httpx.post(url + "/v1/deployments", json=body, timeout=30)
        r.raise_for_status()

        def ready() -> bool:
            reps = httpx.get(f"{url}/v1/deployments/{NAME}", timeout=10).json()["replicas"]
            return any(x["state"] == "ready" for x in reps)

        wait_for("a ready replica", ready, 600)
        # Largest batches first: the curve's means follow the latest steps, and the prompts'
        # point should come from steps as loaded as the runs' (not 8 clients' contention).
        print("[plan-check] calibrating: 8, 4, 2, 1 concurrent streams", flush=True)
        for streams in (8, 4, 2, 1):
            _closed_loop(
                url, streams, 2 * streams + 2, args.plan_words, args.plan_output_tokens, rng
            )
        time.sleep(3)  # a heartbeat carries the curve
        cap = httpx.get(f"{url}/v1/deployments/{NAME}/capacity", timeout=10).json()
        points = tuple((p["step_tokens"], p["tokens_per_second"]) for p in cap["curve"])
        rates = Rates(max(v for _, v in points), points)
        probe: list[dict[str, Any]] = []
        _one(url, _prompt(rng, args.plan_words), 1, probe)
        prompt_tokens = probe[0]["prompt_tokens"]
        # This checks the model on a measured curve, not an estimate of the prompts' prefill
        # (pool/capacity.py, Rates.step_time): the calibration must have measured it.
        if not rates.step_time(prompt_tokens).measured:
            print(f"[plan-check] the calibration measured no prefill of {prompt_tokens}-token "
                  f"prompts: curve {points}", flush=True)  # fmt: skip
            return 1
        w = Workload(1.0, prompt_tokens, args.plan_output_tokens)
        top = _max_rate(w, rates)
        print(f"[plan-check] curve {points}; {prompt_tokens} prompt tokens; model's max "
              f"{top:.3f} req/s", flush=True)  # fmt: skip
        rows = []
        for share in (0.3, 0.5, 0.7):
            rate = share * top
            out = _poisson(
                url, rate, args.plan_requests, args.plan_words, args.plan_output_tokens, rng
            )
            ttfts = [x["ttft"] for x in out if x["ttft"] is not None]
            errors = [x["error"] for x in out if x["error"]]
            p = predict(Workload(rate, prompt_tokens, args.plan_output_tokens), rates)
            measured = pct(ttfts, 0.95)
            rows.append({"share": share, "rate": rate, "predicted_p95": p.ttft_p95,
                         "measured_p95": measured, "predicted_mean": p.ttft_mean,
                         "measured_mean": sum(ttfts) / len(ttfts), "utilization": p.utilization,
                         "errors": len(errors)})  # fmt: skip
            print(f"[plan-check] {json.dumps(rows[-1])}", flush=True)
    print(
        "\n| rate (share of max) | req/s | predicted TTFT p95 | measured | error "
        "| mean (pred / meas) |"
    )
    print("|---|---|---|---|---|---|")
    ok = True
    for row in rows:
        err = row["predicted_p95"] / row["measured_p95"] - 1
        ok &= abs(err) <= 0.25
        print(f"| {row['share']:.0%} | {row['rate']:.3f} | {row['predicted_p95']:.3f} s | "
              f"{row['measured_p95']:.3f} s | {err:+.0%} | {row['predicted_mean']:.3f} / "
              f"{row['measured_mean']:.3f} s |")  # fmt: skip
    print(f"target predicted within 25% at each rate: {'MET' if ok else 'NOT MET'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"plan_check": rows, "curve": points}, indent=2))
    return 0 if all(r["errors"] == 0 for r in rows) else 1
