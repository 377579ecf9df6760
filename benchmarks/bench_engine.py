"""Offline engine throughput: hotpool's LLMEngine vs HF transformers ``generate``.

Same model (a catalog model's snapshot: SmolLM2-135M-Instruct by default, or
``--model gemma3-270m``; HF loads the very same snapshot folder), same dtype, same sampling
settings, same machine, one run. Requests have ~128 prompt tokens and exactly 128 output
tokens (EOS is ignored on both sides). hotpool keeps ``concurrency`` requests in flight (continuous
batching); HF runs padded static batches of ``concurrency``. Prints a table with ratios.

    python benchmarks/bench_engine.py                 # concurrency 1 8 32 64
    python benchmarks/bench_engine.py --model gemma3-270m
    python benchmarks/bench_engine.py --concurrency 32 --requests 64
    python benchmarks/bench_engine.py --concurrency 32 --quantization gguf --hf-gguf

``--quantization int8|gguf`` serves hotpool's linears quantized (gguf: the GGUF's own blocks,
from a snapshot that keeps them; bench_quant.py has the per-format table), and
``--hf-gguf`` has HF load the catalog model's GGUF file itself, as ``from_pretrained(...,
gguf_file=)`` does by default (its dtype included): the peer a user of that file gets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf_snapshots import blocks_snapshot, gguf_file

from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.loader import DTYPES, load_model
from hotpool.worker.models.ops import ops_for
from hotpool.worker.protocol import SamplingParams
from hotpool.worker.snapshot.model_catalog import catalog
from hotpool.worker.snapshot.pull import pull_model

REPO = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 128
TEMPERATURE, TOP_P = 0.8, 0.95


@dataclass(frozen=True)
class Result:
    tokens_per_s: float
    ttft_s: float  # mean time to first token
    tpot_s: float  # mean time per output token after the first


def snapshot(dtype: str, model: str = "smollm2") -> Path:
    cache = REPO / ".cache" / "bench"
    uri, _ = pull_model(
        model, f"file://{cache}/objects", f"{model}-{dtype}", dtype, cache / "downloads"
    )
    return Path(uri.removeprefix("file://"))


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    # Plausible token ids (skip the first 100: special and control tokens).
    return [
        torch.randint(100, vocab, (PROMPT_TOKENS + i % 8,), generator=g).tolist() for i in range(n)
    ]


def bench_hotpool(
    model_dir: Path,
    dtype: torch.dtype,
    reqs: list[list[int]],
    concurrency: int,
    budget: int,
    native: bool = True,
    quantization: str = "none",
) -> Result:
    model = load_model(model_dir, torch.device("cpu"), dtype, quantization=quantization)
    model.native_ops = native
    config = EngineConfig(max_num_seqs=concurrency, max_num_batched_tokens=budget)
    engine = LLMEngine(model, torch.device("cpu"), config)
    engine.capture_decode_graphs()  # as the worker's cold start does (CPU: kernel programs)
    # A replica past its first second or two: the KV cache's pages are in (kv_memory.py).
    engine.kv_cache.populated.wait()
    params = SamplingParams(
        max_tokens=OUTPUT_TOKENS, temperature=TEMPERATURE, top_p=TOP_P, ignore_eos=True
    )
    pending = list(enumerate(reqs))
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(added) - len(done) < concurrency:
            i, p = pending.pop(0)
            engine.add_request(EngineRequest(f"r{i}", tuple(p), params, frozenset()))
            added[f"r{i}"] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finish_reason is not None:
                done[out.request_id] = now
    total = time.perf_counter() - t0
    ttft = statistics.mean(first[r] - added[r] for r in added)
    tpot = statistics.mean((done[r] - first[r]) / (OUTPUT_TOKENS - 1) for r in added)
    return Result(len(reqs) * OUTPUT_TOKENS / total, ttft, tpot)


def bench_hf(
    model_dir: Path,
    dtype: torch.dtype,
    reqs: list[list[int]],
    concurrency: int,
    gguf: Path | None = None,
) -> Result:
    import transformers

    auto = transformers.AutoModelForCausalLM
    if gguf is not None:  # the file, loaded as HF loads it by default
        model = auto.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    else:
        model = auto.from_pretrained(model_dir, dtype=dtype).eval()
    sampling = {"do_sample": True, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": 0}
    ttfts, tpots = [], []
    t0 = time.perf_counter()
    for b in range(0, len(reqs), concurrency):
        batch = reqs[b : b + concurrency]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            s = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=1, pad_token_id=0, **sampling)
            ttft = time.perf_counter() - s
            s = time.perf_counter()
            n = OUTPUT_TOKENS
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                pad_token_id=0, eos_token_id=None, **sampling,
            )  # fmt: skip
            full = time.perf_counter() - s
        ttfts.append(ttft)
        tpots.append((full - ttft) / (OUTPUT_TOKENS - 1))
    # The HF pass ran each batch twice (a 1-token run for TTFT): count only the full runs.
    total = time.perf_counter() - t0 - sum(ttfts)
    return Result(len(reqs) * OUTPUT_TOKENS / total, statistics.mean(ttfts), statistics.mean(tpots))


def bandwidth_limit(model_dir: Path, dtype: torch.dtype) -> tuple[float, float, float]:
    """(weight GB, copy GB/s, tokens/s bound): one decode reads every weight once."""
    model = load_model(model_dir, torch.device("cpu"), dtype, pack=False)
    # Tied embeddings share storage with lm_head: count each storage once.
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    weight_bytes = sum(storages.values())
    src = torch.empty(512 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    gbps = src.numel() / best / 1e9
    return weight_bytes / 1e9, gbps, gbps * 1e9 / weight_bytes


def _timed(fn: object) -> float:
    s = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - s


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument(
        "--requests", type=int, default=64, help="requests per level (capped by --max-seconds)"
    )
    ap.add_argument(
        "--min-requests", type=int, default=4, help="at least this many at concurrency 1"
    )
    ap.add_argument("--model", choices=sorted(catalog()), default="smollm2")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quantization", choices=["none", "int8", "gguf"], default="none")
    ap.add_argument("--hf-gguf", action="store_true", help="HF loads the GGUF file itself")
    ap.add_argument(
        "--torch-ops", action="store_true", help="torch ops instead of the fused C kernels"
    )
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=EngineConfig().max_num_batched_tokens
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    model_dir = snapshot(args.dtype, args.model)
    served = model_dir
    if args.quantization == "gguf":  # the same weights with the GGUF's blocks kept
        served = blocks_snapshot(gguf_file(args.model), args.model)
    gguf = gguf_file(args.model) if args.hf_gguf else None
    config = json.loads((model_dir / "config.json").read_text())
    gb, gbps, bound = bandwidth_limit(model_dir, dtype)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    ops = "torch" if args.torch_ops else ops_for(torch.device("cpu"), dtype, head_dim).name
    if args.quantization != "none" or gguf is not None:
        peer = f"{gguf.name} (its default dtype)" if gguf else f"the {args.dtype} snapshot"
        print(f"hotpool quantization {args.quantization}; HF loads {peer}")
    print(f"{args.model} {args.dtype}, {args.threads} threads, {ops} ops; weights {gb:.3f} GB, "
          f"copy {gbps:.1f} GB/s -> single-stream bound {bound:.1f} tok/s", flush=True)  # fmt: skip
    header = f"{'conc':>4} {'reqs':>4} | {'hotpool tok/s':>13} {'TTFT s':>7} {'TPOT ms':>8} | "
    header += f"{'HF tok/s':>8} {'TTFT s':>7} {'TPOT ms':>8} | {'ratio':>5}"
    print(header)
    print("-" * len(header), flush=True)
    for c in args.concurrency:
        # At low concurrency a full 64-request run takes minutes and adds nothing: steady state
        # is reached after a few requests.
        n = min(args.requests, max(args.min_requests, 2 * c))
        reqs = prompts(n, int(config["vocab_size"]))
        ours = bench_hotpool(
            served, dtype, reqs, c, args.max_num_batched_tokens, not args.torch_ops,
            args.quantization,
        )  # fmt: skip
        line = f"{c:>4} {n:>4} | {ours.tokens_per_s:>13.1f} {ours.ttft_s:>7.2f} "
        line += f"{ours.tpot_s * 1e3:>8.1f} | "
        if args.skip_hf:
            print(line, flush=True)
            continue
        hf = bench_hf(model_dir, dtype, reqs, c, gguf)
        ratio = ours.tokens_per_s / hf.tokens_per_s
        print(
            line
            + f"{hf.tokens_per_s:>8.1f} {hf.ttft_s:>7.2f} {hf.tpot_s * 1e3:>8.1f} | {ratio:>5.2f}",
            flush=True,
        )
        if c == 1:
            rate = 1 / ours.tpot_s
            print(f"     concurrency 1 decode: {rate:.1f} tok/s = {100 * rate / bound:.0f}% "
                  "of the bandwidth bound", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
