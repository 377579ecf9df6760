"""What a JSON schema costs a decode step: hotpool's engine with ``json_schema`` against the
same engine unconstrained, in one run (SmolLM2 bf16 by default).

Each level keeps ``concurrency`` requests in flight (~128 prompt tokens, 128 output
tokens). The constrained requests follow a schema that asks for at least 24 objects in an
array, so every one of them runs its full 128 tokens under the grammar, as the free ones
do (EOS ignored). TPOT = time per output token after the first, averaged over requests.
Target (issue 31): at most 10% slower at concurrency 32. Also printed: the schema's compile
(first request) against the cached one, and the sampler's share of the step (masks are
filled there).

    python benchmarks/bench_structured.py
    python benchmarks/bench_structured.py --concurrency 1 32 --requests 96
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import OUTPUT_TOKENS, prompts, snapshot

from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.loader import DTYPES, load_model
from hotpool.worker.protocol import SamplingParams
from hotpool.worker.structured.grammar import GrammarCompiler
from hotpool.worker.tokenizer import TextTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 24,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 99},
                    "kind": {"enum": ["fruit", "tool", "book"]},
                },
                "required": ["name", "qty", "kind"],
            },
        },
    },
    "required": ["items"],
}
CONSTRAINT = json.dumps({"type": "json_schema", "schema": SCHEMA, "strict": True})


def run(
    engine: LLMEngine, reqs: list[list[int]], concurrency: int, grammars: GrammarCompiler | None
) -> tuple[float, float]:
    """(TPOT s, sampler share of the wall time) for one level."""
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.8, top_p=0.95, ignore_eos=True)
    pending = list(enumerate(reqs))
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    counts: dict[str, int] = {}
    running = 0
    sampler0 = engine.runner.sampler_seconds
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and running < concurrency:
            i, p = pending.pop(0)
            grammar = grammars.matcher(CONSTRAINT) if grammars else None
            engine.add_request(EngineRequest(f"r{i}", tuple(p), params, frozenset(), grammar))
            running += 1
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finish_reason is not None:
                done[out.request_id] = now
                running -= 1
    wall = time.perf_counter() - t0
    tpot = statistics.mean((done[r] - first[r]) / max(counts[r] - 1, 1) for r in done)
    return tpot, (engine.runner.sampler_seconds - sampler0) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--requests", type=int, default=96, help="requests per level (c >= 8)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = ap.parse_args()
    model_dir = snapshot(args.dtype, args.model)
    model = load_model(model_dir, torch.device("cpu"), DTYPES[args.dtype])
    tok = TextTokenizer(model_dir)
    t0 = time.perf_counter()
    grammars = GrammarCompiler(tok.to_json(), model.config.vocab_size, tok.eos_token_ids)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.matcher(CONSTRAINT)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.matcher(CONSTRAINT)
    warm = time.perf_counter() - t0
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads; grammar engine "
          f"setup {setup:.2f} s; schema compile {cold * 1e3:.2f} ms, cached "
          f"{warm * 1e3:.3f} ms")  # fmt: skip
    header = f"{'conc':>4} {'reqs':>4} | {'free TPOT ms':>12} {'sampler':>7} | "
    header += f"{'schema TPOT ms':>14} {'sampler':>7} | {'slower':>6}"
    print(header)
    print("-" * len(header), flush=True)
    for c in args.concurrency:
        n = max(4, min(args.requests, 3 * c))
        reqs = prompts(n, model.config.vocab_size)
        config = EngineConfig(max_num_seqs=c)
        free, free_share = run(LLMEngine(model, torch.device("cpu"), config), reqs, c, None)
        ours, share = run(LLMEngine(model, torch.device("cpu"), config), reqs, c, grammars)
        print(f"{c:>4} {n:>4} | {free * 1e3:>12.1f} {100 * free_share:>6.1f}% | "
              f"{ours * 1e3:>14.1f} {100 * share:>6.1f}% | {100 * (ours / free - 1):>5.1f}%",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
