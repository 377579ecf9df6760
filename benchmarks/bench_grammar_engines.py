"""xgrammar vs llguidance on this machine, with a real tokenizer: what hotpool's choice of
grammar engine rests on (hotpool.worker.structured uses llguidance).

For each engine: the tokenizer's one-time setup, a schema's compile (cold), and the work
of one decode step per constrained row (fill the next-token bitmask, accept the token),
over a JSON document generated under the schema's own mask. Run on a quiet machine:

    python benchmarks/bench_grammar_engines.py                  # SmolLM2's tokenizer
    python benchmarks/bench_grammar_engines.py --model gemma3-270m   # a 262k vocabulary
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import snapshot

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                },
                "required": ["id", "email", "tags"],
            },
            "role": {"enum": ["admin", "user", "guest"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["user", "role", "score"],
    },
}


def _walk(step: Any, accept: Any, vocab: int, n: int = 64) -> list[float]:
    """Seconds per step of mask + accept, taking the lowest allowed token each time."""
    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if not step(mask):
            break
        bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[:vocab].nonzero()
        if len(allowed) == 0:
            break
        token = int(allowed[min(len(allowed) - 1, 7)])  # not always the same token
        if not accept(token):
            break
        times.append(time.perf_counter() - t0)
    return times


def bench_llguidance(tokenizer_json: str, vocab: int, eos: list[int]) -> dict[str, Any]:
    import llguidance
    from llguidance.torch import fill_next_token_bitmask

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    out: dict[str, Any] = {"setup_s": time.perf_counter() - t0}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        fill_next_token_bitmask(m, torch.empty(1, (vocab + 31) // 32, dtype=torch.int32))
        out[f"{name}_compile_ms"] = 1e3 * (time.perf_counter() - t0)
        m.reset()

        def step(mask: torch.Tensor, m: Any = m) -> bool:
            fill_next_token_bitmask(m, mask)
            return not m.is_stopped()

        times = _walk(step, m.consume_token, vocab)
        out[f"{name}_step_us"] = 1e6 * statistics.median(times) if times else float("nan")
    return out


def bench_xgrammar(hf_tokenizer: Any, vocab: int) -> dict[str, Any]:
    import xgrammar

    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    out: dict[str, Any] = {"setup_s": time.perf_counter() - t0}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        m = xgrammar.GrammarMatcher(compiled)
        out[f"{name}_compile_ms"] = 1e3 * (time.perf_counter() - t0)

        def step(mask: torch.Tensor, m: Any = m) -> bool:
            m.fill_next_token_bitmask(mask, 0)
            return not m.is_terminated()

        times = _walk(step, m.accept_token, vocab)
        out[f"{name}_step_us"] = 1e6 * statistics.median(times) if times else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    import transformers

    torch.set_num_threads(2)
    snap = snapshot("bf16", args.model)
    hf = transformers.AutoTokenizer.from_pretrained(snap)
    vocab = json.loads((snap / "config.json").read_text())["vocab_size"]
    eos = [hf.eos_token_id]
    rows = {
        "llguidance": bench_llguidance((snap / "tokenizer.json").read_text(), vocab, eos),
        "xgrammar": bench_xgrammar(hf, vocab),
    }
    keys = list(rows["llguidance"])
    print(f"{args.model}: vocabulary {vocab}")
    print(f"{'':24}" + "".join(f"{k:>12}" for k in rows))
    for k in keys:
        print(f"{k:24}" + "".join(f"{rows[e][k]:12.2f}" for e in rows))


if __name__ == "__main__":
    main()
