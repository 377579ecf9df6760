"""llama.cpp's decode speed on a GGUF, through llama-cpp-python: the peer side of
``benchmarks/bench_quant.py``, which runs this script in the peer's own venv
(``benchmarks/peers/llama_cpp_venv.sh``) so that the project's venv never imports it.

Reads the prompts (lists of token ids) from a JSON file, prints one JSON object on stdout:

- ``levels``: for each concurrency, greedy decoding of exactly ``--max-tokens`` tokens per
  request (EOS ignored) with llama.cpp's batch API: each wave of ``concurrency`` requests is
  prefilled in one ``llama_decode`` and then decoded one token per sequence per call, the
  way llama.cpp's ``batched`` example and its server's slots do. All requests of a wave have
  the same output length, so waves lose nothing to continuous batching here.
- ``generate``: concurrency 1 through the high-level ``Llama.generate`` (what most users
  call), as a cross-check of the batch-API figure, with llama.cpp's own decode timings.

    .cache/peers/llama-cpp-venv/bin/python benchmarks/peers/llama_cpp_decode.py \\
        --model M.gguf --prompts prompts.json --concurrency 1 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import llama_cpp as L
import numpy as np


def decode(ctx: object, batch: object, entries: list[tuple[int, int, int, bool]]) -> None:
    """One ``llama_decode`` of (token, position, sequence, wants logits) entries."""
    for k, (tok, pos, seq, want) in enumerate(entries):
        batch.token[k], batch.pos[k], batch.n_seq_id[k] = tok, pos, 1
        batch.seq_id[k][0], batch.logits[k] = seq, int(want)
    batch.n_tokens = len(entries)
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")


def argmax(ctx: object, i: int, n_vocab: int) -> int:
    """Greedy pick from the logits of the batch's ``i``-th token."""
    return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (n_vocab,)).argmax())


def run_level(model: object, reqs: list[list[int]], c: int, max_tokens: int, threads: int) -> dict:
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cparams = L.llama_context_default_params()
    per_seq = max(len(p) for p in reqs) + max_tokens + 16
    cparams.n_ctx = max(512, -(-c * per_seq // 256) * 256)
    cparams.n_batch = cparams.n_ctx  # a whole wave's prompts in one llama_decode
    cparams.n_ubatch = 512
    cparams.n_seq_max = c
    cparams.kv_unified = True
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit(f"llama.cpp could not make a context at concurrency {c}")
    batch = L.llama_batch_init(cparams.n_batch, 0, 1)
    mem = L.llama_get_memory(ctx)
    # Warm-up: one short request (first-call costs stay out of the figures).
    decode(ctx, batch, [(t, p, 0, p == 7) for p, t in enumerate(reqs[0][:8])])
    L.llama_memory_clear(mem, True)
    ttfts, tpots = [], []
    t0 = time.perf_counter()
    for w in range(0, len(reqs), c):
        wave = reqs[w : w + c]
        start = time.perf_counter()
        entries, rows = [], []
        for s, p in enumerate(wave):
            entries += [(t, i, s, i == len(p) - 1) for i, t in enumerate(p)]
            rows.append(len(entries) - 1)
        decode(ctx, batch, entries)
        last = [argmax(ctx, r, n_vocab) for r in rows]
        first = time.perf_counter()
        pos = [len(p) for p in wave]
        for _ in range(max_tokens - 1):
            decode(ctx, batch, [(last[s], pos[s], s, True) for s in range(len(wave))])
            last = [argmax(ctx, s, n_vocab) for s in range(len(wave))]
            pos = [q + 1 for q in pos]
        end = time.perf_counter()
        ttfts += [first - start] * len(wave)
        tpots += [(end - first) / (max_tokens - 1)] * len(wave)
        L.llama_memory_clear(mem, True)
    total = time.perf_counter() - t0
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    return {
        "concurrency": c,
        "requests": len(reqs),
        "tokens_per_s": len(reqs) * max_tokens / total,
        "ttft_s": statistics.mean(ttfts),
        "tpot_s": statistics.mean(tpots),
    }


def batch_levels(
    path: str, prompts: list[list[int]], levels: dict[int, int], max_tokens: int, threads: int
) -> tuple[list[dict], int]:
    """``levels``: concurrency -> requests (the first that many prompts)."""
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    size = int(L.llama_model_size(model))
    out = [run_level(model, prompts[:n], c, max_tokens, threads) for c, n in levels.items()]
    L.llama_model_free(model)
    return out, size


def generate_c1(path: str, prompts: list[list[int]], max_tokens: int, threads: int) -> dict:
    llm = L.Llama(
        model_path=path,
        n_ctx=max(512, max(len(p) for p in prompts) + max_tokens + 16),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    reqs = prompts[:4]
    for _ in llm.generate(reqs[0][:8], temp=0.0):  # warm-up
        break
    ttfts, tpots, evals = [], [], []
    t0 = time.perf_counter()
    for p in reqs:
        llm.reset()
        L.llama_perf_context_reset(llm.ctx)
        start = time.perf_counter()
        for n, _tok in enumerate(llm.generate(p, temp=0.0, reset=True), 1):
            if n == 1:
                first = time.perf_counter()
            if n == max_tokens:
                break
        end = time.perf_counter()
        perf = L.llama_perf_context(llm.ctx)
        ttfts.append(first - start)
        tpots.append((end - first) / (max_tokens - 1))
        if perf.n_eval > 0:
            evals.append(perf.n_eval / (perf.t_eval_ms / 1e3))
    total = time.perf_counter() - t0
    return {
        "concurrency": 1,
        "requests": len(reqs),
        "tokens_per_s": len(reqs) * max_tokens / total,
        "ttft_s": statistics.mean(ttfts),
        "tpot_s": statistics.mean(tpots),
        # llama.cpp's own count: decode calls of one token over their compute time.
        "perf_eval_tokens_per_s": statistics.mean(evals) if evals else None,
    }


def without_extra_bufts() -> None:
    """Model loads from here on keep the GGUF's weights in plain buffers: no repacking, so
    no AMX path. ggml's AMX matmul executed tile instructions in threads that had loaded no
    tile configuration and died of SIGILL on the project's Sapphire Rapids machines (of SIGSEGV
    on others)."""
    default = L.llama_cpp.llama_model_default_params

    def params() -> object:
        p = default()
        p.use_extra_bufts = False
        return p

    L.llama_model_default_params = params
    L.llama_cpp.llama_model_default_params = params  # what Llama() calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument(
        "--requests", type=int, nargs="+", help="requests per level (default: max(4, 2c))"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument(
        "--no-extra-bufts",
        action="store_true",
        help="no repacked weight buffers (ggml's AMX path among them)",
    )
    args = ap.parse_args()
    if args.no_extra_bufts:
        without_extra_bufts()
    L.llama_backend_init()
    with open(args.prompts) as f:
        prompts = json.load(f)
    counts = args.requests or [max(4, 2 * c) for c in args.concurrency]
    if len(counts) != len(args.concurrency):
        raise SystemExit("--requests needs one count per --concurrency")
    levels = {c: min(n, len(prompts)) for c, n in zip(args.concurrency, counts, strict=True)}
    levels_out, size = batch_levels(args.model, prompts, levels, args.max_tokens, args.threads)
    result = {
        "version": L.__version__,
        "extra_bufts": not args.no_extra_bufts,
        "threads": args.threads,
        "weight_bytes": size,
        "system_info": L.llama_print_system_info().decode(),
        "levels": levels_out,
    }
    if not args.skip_generate:
        result["generate"] = generate_c1(args.model, prompts, args.max_tokens, args.threads)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
