"""Decode speed of quantized serving: hotpool's LLMEngine with its weights in bf16, fp32,
int8 and the GGUF's own blocks, against llama.cpp (the peer a CPU user would pick, through
llama-cpp-python) on the same GGUF file, in one run, with each format's bandwidth bound.

hotpool serves a snapshot converted from the catalog model's GGUF with its blocks kept
(``convert_gguf(..., "fp32", keep_blocks=True)``, cached under ``.cache/bench``). Variants:
``bf16`` (dequantized weights and activations in bf16: what a bf16 engine reads), ``fp32``
(the same in fp32, the fast dtype on a CPU without native bf16), ``int8`` (the Q8_0-style
int8 made from them at load) and ``gguf`` (the file's own blocks; SmolLM2: Q4_1 layers, Q8_0
LM head). The quantized variants compute in what a deployment gets by default on this CPU
(bf16 where it is native, fp32 elsewhere; ``--quant-dtype`` picks one). llama.cpp loads the
GGUF itself.
Requests have ~128 random prompt tokens and exactly 64 greedy output tokens (EOS ignored)
on both sides; hotpool keeps ``concurrency`` requests in flight, llama.cpp runs waves of
``concurrency`` sequences through its batch API (``benchmarks/peers/llama_cpp_decode.py``,
which runs in its own venv: build it once with ``bash benchmarks/peers/llama_cpp_venv.sh``;
without it the llama.cpp rows are skipped). Each side gets one warm-up request per model.

The bandwidth bound of a format is the single stream's ceiling when every decode step
reads each weight once: measured copy bandwidth (bytes read + written per second, the best
of a few 256 MB copies) over the bytes of weights a step reads (``read MB``: all but an
embedding table that is not also the LM head; llama.cpp's: its whole model). Prints a
table, the ratios to llama.cpp and to bf16, and each single stream's share of its bound.
A single stream is weighed by its decode speed (``dec tok/s``, one token a TPOT: its
prompt's prefill is the same work in every format), concurrent streams by throughput
(``tok/s``: generated tokens over the whole run, prefills included).

    python benchmarks/bench_quant.py                    # concurrency 1 32, every variant
    python benchmarks/bench_quant.py --concurrency 1 --variants fp32 gguf
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_engine import Result, prompts
from gguf_snapshots import blocks_snapshot, gguf_file

from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.models.loader import load_model
from hotpool.worker.protocol import SamplingParams
from hotpool.worker.service import default_dtype
from hotpool.worker.snapshot.model_catalog import catalog

REPO = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO / ".cache" / "peers" / "llama-cpp-venv" / "bin" / "python"
PEER_SCRIPT = REPO / "benchmarks" / "peers" / "llama_cpp_decode.py"
OUTPUT_TOKENS = 64


def weight_bytes(model: LlamaModel) -> int:
    """Bytes of weights a decode step reads: every weight the model holds (parameters,
    quantized buffers and packed copies, each storage once; the rotary tables are not
    weights) but the embedding table, which is read a row a token, unless it is the LM
    head's own weight too (tied and not repacked)."""
    tensors = [p for _, p in model.named_parameters()]
    tensors += [
        b for n, b in model.named_buffers() if not n.split(".")[0].endswith("rope")
    ]  # fmt: skip
    # Packed bf16 linears keep their weight as a plain attribute, not a parameter
    tensors += [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    embed = model.embed.weight.untyped_storage()
    head = getattr(model.lm_head, "weight", None)
    shared = isinstance(head, torch.Tensor) and (
        head.untyped_storage().data_ptr() == embed.data_ptr()
    )
    return sum(held.values()) - (0 if shared else embed.nbytes())


# Variant -> (quantization, activation dtype; None: the serving default of this CPU).
VARIANTS: dict[str, tuple[str, torch.dtype | None]] = {
    "bf16": ("none", torch.bfloat16),
    "fp32": ("none", torch.float32),
    "int8": ("int8", None),
    "gguf": ("gguf", None),
}
QUANT_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second a large copy moves (read + written), the best of ``repeats``."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def run_engine(model: LlamaModel, reqs: list[list[int]], concurrency: int) -> Result:
    config = EngineConfig(max_num_seqs=concurrency)
    engine = LLMEngine(model, torch.device("cpu"), config)
    engine.capture_decode_graphs()  # as the worker's cold start does (CPU: kernel programs)
    engine.kv_cache.populated.wait()  # a replica past its first second or two
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
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


def warm_up(model: LlamaModel) -> None:
    engine = LLMEngine(model, torch.device("cpu"), EngineConfig(max_num_seqs=1))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("warm", tuple(range(100, 120)), params, frozenset()))
    while engine.has_unfinished():
        engine.step()


def run_llama_cpp(
    gguf: Path, reqs: list[list[int]], levels: dict[int, int], threads: int
) -> tuple[dict | None, str]:
    """llama.cpp's figures (the peer script's JSON), or None and why not."""
    if not PEER_PYTHON.is_file():
        return None, f"no {PEER_PYTHON.relative_to(REPO)}: bash benchmarks/peers/llama_cpp_venv.sh"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(reqs, f)
    cmd = [str(PEER_PYTHON), str(PEER_SCRIPT), "--model", str(gguf), "--prompts", f.name,
           "--concurrency", *map(str, levels), "--requests", *map(str, levels.values()),
           "--max-tokens", str(OUTPUT_TOKENS), "--threads", str(threads)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if proc.returncode in (-signal.SIGILL, -signal.SIGSEGV):
            # ggml's AMX path dies on some AMX CPUs (SIGILL on the project's Sapphire
            # Rapids machines, SIGSEGV on others): llama.cpp at its best that runs
            died = signal.Signals(-proc.returncode).name
            print(f"llama.cpp died of {died} with repacked (AMX) weights: rerun without "
                  "them (--no-extra-bufts)", flush=True)  # fmt: skip
            cmd.append("--no-extra-bufts")
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired:
        return None, "llama.cpp run timed out"
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        return None, f"llama.cpp run failed ({proc.returncode}): {proc.stderr.strip()[-600:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


def _decode(r: Result) -> float:
    """A stream's decode tokens/s: one token a TPOT."""
    return 1.0 / r.tpot_s


def _throughput(r: Result) -> float:
    return r.tokens_per_s


def requests_at(c: int, cap: int, minimum: int) -> int:
    # Steady state comes after a few requests: a full run at low concurrency adds nothing.
    return min(cap, max(minimum, 2 * c))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--requests", type=int, default=64, help="cap on requests per level")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--model", choices=sorted(catalog()), default="smollm2")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--quant-dtype", choices=list(QUANT_DTYPES), default="auto",
                    help="int8 / gguf activations (auto: a deployment's default here)")  # fmt: skip
    args = ap.parse_args()
    quant_dtype = QUANT_DTYPES[args.quant_dtype] or default_dtype(torch.device("cpu"), "int8")
    torch.set_num_threads(args.threads)
    gguf = gguf_file(args.model)
    model_dir = blocks_snapshot(gguf, args.model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    n_max = max(requests_at(c, args.requests, args.min_requests) for c in args.concurrency)
    reqs = prompts(n_max, vocab)
    bandwidth = copy_bandwidth()
    print(f"{args.model}: {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB), "
          f"{args.threads} threads, {OUTPUT_TOKENS} greedy tokens/request; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s", flush=True)  # fmt: skip

    load = os.getloadavg()[0]
    if load > 0.5:
        # OpenMP workers spin at barriers: on a busy core llama.cpp's step can take 50x longer.
        print(f"warning: load average {load:.1f} before the run; the figures need a quiet "
              "machine", flush=True)  # fmt: skip

    rows: dict[tuple[str, int], Result] = {}
    held: dict[str, int] = {}
    peer, why = (None, "--skip-llama-cpp") if args.skip_llama_cpp else (None, "")
    if not args.skip_llama_cpp:
        levels = {c: requests_at(c, args.requests, args.min_requests) for c in args.concurrency}
        peer, why = run_llama_cpp(gguf, reqs, levels, args.threads)
    if peer is not None:
        held["llama.cpp"] = int(peer["weight_bytes"])
        for lv in peer["levels"]:
            r = Result(lv["tokens_per_s"], lv["ttft_s"], lv["tpot_s"])
            rows[("llama.cpp", int(lv["concurrency"]))] = r
        print(f"llama-cpp-python {peer['version']}: {peer['system_info'].strip()}", flush=True)
    else:
        print(f"llama.cpp skipped: {why}", flush=True)

    for q in args.variants:
        s = time.perf_counter()
        quantization, dtype = VARIANTS[q]
        dtype = dtype or quant_dtype
        model = load_model(model_dir, torch.device("cpu"), dtype, quantization=quantization)
        load_s = time.perf_counter() - s
        held[q] = weight_bytes(model)
        report = model.quantization
        note = ""
        if report is not None:
            note = f", {len(report.quantized)} linears quantized, {len(report.dense)} dense"
        print(f"hotpool {q} ({str(dtype).removeprefix('torch.')} activations): loaded in "
              f"{load_s:.1f} s, reads {held[q] / 1e6:.0f} MB a step{note}",
              flush=True)  # fmt: skip
        warm_up(model)
        for c in args.concurrency:
            n = requests_at(c, args.requests, args.min_requests)
            rows[(q, c)] = run_engine(model, reqs[:n], c)
        del model

    engines = [e for e in [*args.variants, "llama.cpp"] if any(k[0] == e for k in rows)]
    header = f"{'engine':<16} {'conc':>4} {'reqs':>4} | {'tok/s':>7} {'TTFT s':>7} "
    header += f"{'TPOT ms':>8} {'dec tok/s':>9} | {'read MB':>10} {'bound tok/s':>11} "
    header += f"{'of bound':>8} | {'vs llama.cpp':>12} {'vs bf16':>7}"
    print()
    print(header)
    print("-" * len(header))
    for c in args.concurrency:
        peer_row = rows.get(("llama.cpp", c))
        bf16_row = rows.get(("bf16", c))
        for e in engines:
            r = rows.get((e, c))
            if r is None:
                continue
            name = e if e == "llama.cpp" else f"hotpool {e}"
            bound = bandwidth / held[e]  # tok/s of one stream reading every weight per token
            # One stream is compared by its decode speed (1 / TPOT: the prefill is the same
            # work in every format); concurrent streams by their throughput.
            speed = _decode if c == 1 else _throughput
            share = f"{_decode(r) / bound:>8.0%}" if c == 1 else f"{'':>8}"
            vs_peer = speed(r) / speed(peer_row) if peer_row else None
            vs_bf16 = speed(r) / speed(bf16_row) if bf16_row else None
            print(f"{name:<16} {c:>4} {requests_at(c, args.requests, args.min_requests):>4} | "
                  f"{r.tokens_per_s:>7.1f} {r.ttft_s:>7.2f} {r.tpot_s * 1e3:>8.1f} "
                  f"{_decode(r):>9.1f} | "
                  f"{held[e] / 1e6:>10.0f} {bound:>11.1f} {share} | "
                  + (f"{vs_peer:>12.2f}" if vs_peer and e != "llama.cpp" else f"{'':>12}")
                  + (f" {vs_bf16:>7.2f}" if vs_bf16 and e != "bf16" else f" {'':>7}"))  # fmt: skip
    print()
    if peer is not None and "generate" in peer:
        g = peer["generate"]
        perf = g.get("perf_eval_tokens_per_s")
        print(f"llama.cpp c=1 through Llama.generate (cross-check): {g['tokens_per_s']:.1f} tok/s, "
              f"TTFT {g['ttft_s']:.2f} s, TPOT {g['tpot_s'] * 1e3:.1f} ms"
              + (f"; its own decode timing {perf:.1f} tok/s" if perf else ""))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
