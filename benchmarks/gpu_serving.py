"""The engine on a GPU: throughput, TTFT, TPOT and the decode step against the HBM bound.

    python benchmarks/gpu_serving.py [--quick]   # or: bash benchmarks/run_gpu_checks.sh --serving

hotpool's ``LLMEngine`` on CUDA (the Triton attention and sampler, chosen by the device),
bf16, greedy, every request ``--prompt-tokens`` long and decoding ``--max-tokens`` tokens
(``ignore_eos``), at each concurrency of ``--concurrency`` (all requests added at once;
prefix caching off, so nothing is shared), eagerly and with decode steps replayed as CUDA
graphs (``worker/engine/decode_graphs.py``; the capture's seconds printed beside). Per
model, mode and concurrency it prints output tok/s,
TTFT p50, TPOT p50 (a request's decode time over its tokens after the first), the median
pure-decode step, and the weight bytes over the device's copy bandwidth (reads + writes of
a 2 GiB copy): the step's bound when it only read the weights once.

The models have the shapes of SmolLM2-135M and Llama-3-8B with random weights (what their
speed depends on; the machine has no network and the device tool carries 64 MiB, so no
checkpoint travels). The first greedy outputs of the small model are printed as a
fingerprint, and every request's greedy output with graphs is compared with eager mode's
(token for token; the first difference is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from gpu_kernels import fail, import_hotpool
from gpu_quant import copy_gbps


@dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool


# Prefill chunk budget per step: vLLM's default for throughput serving; 256 prompts of 128
# tokens prefill in 4 steps.
BATCHED_TOKENS = 8192
SMOLLM2 = Shape("smollm2-135m", 49152, 576, 1536, 30, 9, 3, True)
LLAMA3_8B = Shape("llama3-8b", 128256, 4096, 14336, 32, 32, 8, False)


@dataclass
class Run:
    tok_s: float
    ttft_p50: float
    tpot_p50: float
    decode_step: float
    outputs: dict[str, list[int]]
    capture_s: float


def build(shape: Shape) -> torch.nn.Module:
    from hotpool.worker.models.config import ModelConfig
    from hotpool.worker.models.llama import LlamaModel

    cfg = ModelConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.hidden // shape.heads,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_word_embeddings=shape.tied, bos_token_id=None, eos_token_ids=(0,),
    )  # fmt: skip
    with torch.device("cuda"):
        model = LlamaModel(cfg)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            values = torch.randn(p.shape, device="cuda", generator=g) * 0.02
            if name.endswith("norm.weight"):
                values += 1.0
            p.data = values.to(torch.bfloat16)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(
    model: torch.nn.Module, concurrency: int, prompt: int, max_tokens: int, graphs: bool
) -> Run:
    from hotpool.worker.engine.base import EngineRequest
    from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
    from hotpool.worker.protocol import SamplingParams

    config = EngineConfig(
        kv_cache_bytes=8 << 30,
        max_num_seqs=concurrency,
        max_num_batched_tokens=max(BATCHED_TOKENS, prompt),
        enable_prefix_caching=False,
        cuda_graphs=graphs,
    )
    engine = LLMEngine(model, torch.device("cuda"), config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = model.config.vocab_size  # type: ignore[attr-defined]
    warm = EngineRequest("warm", tuple(range(1, 17)), SamplingParams(max_tokens=4), frozenset())
    engine.add_request(warm)
    while engine.has_unfinished():
        engine.step()
    capture_s = engine.capture_decode_graphs()  # what the cold start's warm-up does
    torch.cuda.synchronize()
    g = torch.Generator().manual_seed(concurrency)
    start: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i in range(concurrency):
        ids = torch.randint(1, vocab, (prompt,), generator=g).tolist()
        rid = f"r{i}"
        engine.add_request(EngineRequest(rid, tuple(ids), params, frozenset()))
        start[rid] = time.perf_counter()
        outputs[rid] = []
    decode_steps: list[float] = []
    while engine.has_unfinished():
        s0 = time.perf_counter()
        outs = engine.step()  # returns once the sampled ids are on the host
        now = time.perf_counter()
        stats = engine.stats()
        if stats.last_step_tokens == stats.num_running + sum(
            1 for o in outs if o.finish_reason is not None
        ):
            decode_steps.append(now - s0)
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                outputs[o.request_id].extend(o.new_token_ids)
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in outputs.values())
    ttft = [first[r] - start[r] for r in start]
    tpot = [(last[r] - first[r]) / max(1, len(outputs[r]) - 1) for r in start]
    step = statistics.median(decode_steps) if decode_steps else float("nan")
    if graphs:
        assert engine.decode_graphs is not None and engine.decode_graphs.replays > 0
    del engine
    torch.cuda.empty_cache()
    return Run(
        tokens / wall, statistics.median(ttft), statistics.median(tpot), step, outputs, capture_s
    )


def compare(eager: dict[str, list[int]], graphed: dict[str, list[int]]) -> str:
    for rid, want in eager.items():
        got = graphed[rid]
        if got != want:
            pairs = enumerate(zip(want, got, strict=False))
            at = next((i for i, (a, b) in pairs if a != b), min(len(want), len(got)))
            return f"DIFFER ({rid} at token {at}: {want[at : at + 3]} vs {got[at : at + 3]})"
    return "equal"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model only")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        fail("no CUDA device is visible to torch; these checks need a GPU")
    os.environ.pop("TRITON_INTERPRET", None)
    import_hotpool()
    copy = copy_gbps()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {copy:.0f} GB/s")
    head = (
        f"{'model':>13} {'mode':>6} {'conc':>5} | {'tok/s':>9} {'TTFT p50':>9} "
        f"{'TPOT p50':>9} {'step ms':>8} {'bound ms':>8} {'of bound':>8} | capture s, greedy"
    )
    print(f"\n{head}\n" + "-" * len(head))
    failures = 0
    for shape in [SMOLLM2] if args.quick else [SMOLLM2, LLAMA3_8B]:
        model = build(shape)
        bound_ms = weight_bytes(model) / copy / 1e6
        levels = args.concurrency if shape is SMOLLM2 else [c for c in args.concurrency if c <= 32]
        for c in levels:
            runs = {}
            for mode in ("eager", "graphs"):
                r = runs[mode] = run(
                    model, c, args.prompt_tokens, args.max_tokens, mode == "graphs"
                )
                step_ms = r.decode_step * 1e3
                extra = ""
                if mode == "graphs":
                    same = compare(runs["eager"].outputs, r.outputs)
                    failures += same != "equal"
                    speedup = runs["eager"].decode_step / r.decode_step
                    extra = f"{r.capture_s:5.2f}, {same}; step {speedup:.1f}x faster"
                print(
                    f"{shape.name:>13} {mode:>6} {c:>5} | {r.tok_s:9.0f} "
                    f"{r.ttft_p50 * 1e3:7.1f}ms {r.tpot_p50 * 1e3:7.2f}ms {step_ms:8.3f} "
                    f"{bound_ms:8.3f} {bound_ms / step_ms:8.1%} | {extra}",
                    flush=True,
                )
            if shape is SMOLLM2 and c == 1:
                print(f"{'':>13} greedy fingerprint: {runs['eager'].outputs['r0'][:12]}")
        del model
        torch.cuda.empty_cache()
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    sys.exit(main())
