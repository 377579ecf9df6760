"""hotpool's CPU sampler against HF transformers' logits processors, on the same logits.

For each vocabulary, batch size and mix of sampling settings, times one call of hotpool's
``sample`` for rows that do not ask for logprobs (as the engine builds them for a request
without ``logprobs``; HF computes none either), the same call with every row's raw logprob
(``+logprob ms``), the same call under a grammar's token bitmask that allows a random half
of the vocabulary in each row (``+mask ms``, structured outputs: the worst case for the C
sampler, whose weights pass slows down on rows with -inf logits at random places; a mask
that allows a few tokens makes a row cheaper than none), and HF's chain
(``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
``MinPLogitsWarper`` as the setting needs, then ``softmax`` and ``torch.multinomial``; greedy
is ``argmax``) and prints milliseconds per call, the logits hotpool gets through per second
and HF's time over hotpool's. The ``mixed`` batch cycles through greedy, top-k, top-p-only
and min-p rows, as a server's batch does: hotpool samples it in one call, HF in one chain
per kind of row (it has no per-row parameters).

The default logits follow a language model's shape: sorted, a row falls off like
``-a * log(rank)`` with ``a`` between 1.1 and 3, which matches SmolLM2's logits at the
median and both tails within a factor of two (nucleus sizes included). ``--logits flat``
uses ``randn`` rows instead: the worst case for top-p, whose nucleus then holds most of
the vocabulary.

A second table puts the sampler in the engine (issue 4's "at most 5% of a decode step"):
hotpool's ``LLMEngine`` runs SmolLM2-135M-Instruct (bf16, the snapshot ``bench_engine.py``
pulls) with ``--engine-batch`` requests of ~128 prompt tokens in flight, each mix as
``SamplingParams`` (the mixed batch cycles per request), and times ``--engine-steps`` decode
steps: the step's wall time and the part of it spent in ``sample`` (the model runner's
``sampler_seconds``). Beside it, HF's chain for the same mix on logits of the step's shape,
and the share of the step it would take in the sampler's place. ``--engine-batch 0`` skips it.

    python benchmarks/bench_sampling.py                      # B 1 32 128, V 49152 128256
    python benchmarks/bench_sampling.py --batch 32 --vocab 49152 --threads 1
    python benchmarks/bench_sampling.py --batch 32 --vocab 49152 --engine-batch 32 64
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hotpool.kernels.sampling import SamplingRow, sample
from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.loader import DTYPES, load_model
from hotpool.worker.protocol import SamplingParams

NUM_OUTPUT_TOKENS = 64  # history each row carries for the penalty settings
STEP_SHARE_TARGET = 0.05  # the sampler's most of a decode step in the engine
PROMPT_TOKENS = 128


@dataclass(frozen=True)
class Setting:
    name: str
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0


GREEDY = Setting("greedy", temperature=0.0)
TOP_K = Setting("T=0.7 top_k=50", temperature=0.7, top_k=50)
TOP_P = Setting("T=1 top_p=0.95 (top-p only)", top_p=0.95)
MIN_P = Setting("T=1 min_p=0.05", min_p=0.05)
SETTINGS = [
    GREEDY,
    Setting("T=0.7", temperature=0.7),
    TOP_K,
    Setting("T=0.7 top_p=0.9", temperature=0.7, top_p=0.9),
    TOP_P,
    MIN_P,
    Setting(
        "T=0.7 top_k=50 top_p=0.9 presence=0.5",
        temperature=0.7,
        top_k=50,
        top_p=0.9,
        presence_penalty=0.5,
    ),
]
MIXED = [GREEDY, TOP_K, TOP_P, MIN_P]  # row i of the mixed batch uses MIXED[i % 4]


def lm_like_logits(batch: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    slope = torch.empty(batch, 1).uniform_(math.log(1.1), math.log(3.0), generator=g).exp()
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    profile = -slope * ranks.log() + 0.3 * torch.randn(batch, vocab, generator=g)
    order = torch.rand(batch, vocab, generator=g).argsort(dim=1)  # which token has which rank
    return torch.empty(batch, vocab).scatter_(1, order, profile) + 10.0


def row_for(s: Setting, history: tuple[int, ...], logprob: bool) -> SamplingRow:
    return SamplingRow(
        logprob=logprob,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        output_token_ids=history if s.presence_penalty else (),
    )


def hotpool_call(
    logits: torch.Tensor,
    settings: list[Setting],
    outputs: torch.Tensor,
    logprob: bool,
    mask: torch.Tensor | None = None,
) -> Callable[[], object]:
    history = [tuple(row) for row in outputs.tolist()]
    n = len(settings)
    rows = [row_for(settings[i % n], history[i], logprob) for i in range(logits.shape[0])]
    return lambda: sample(logits, rows, token_bitmask=mask)


def half_mask(batch: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """A token bitmask (llguidance's layout) whose random bits allow about half the tokens."""
    words = torch.randint(-(2**31), 2**31, (batch, (vocab + 31) // 32), generator=g)
    return words.to(torch.int32)


def hf_chain(logits: torch.Tensor, s: Setting, outputs: torch.Tensor) -> Callable[[], object]:
    if s.temperature == 0.0:
        return lambda: logits.argmax(dim=-1)
    chain = LogitsProcessorList([TemperatureLogitsWarper(s.temperature)])
    if s.top_k:
        chain.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1.0:
        chain.append(TopPLogitsWarper(s.top_p))
    if s.min_p:
        chain.append(MinPLogitsWarper(s.min_p))

    def run() -> torch.Tensor:
        scores = logits
        if s.presence_penalty:  # HF has no presence penalty: the plain torch an HF user writes
            seen = torch.zeros_like(scores).scatter_(1, outputs, 1.0)
            scores = scores - s.presence_penalty * seen
        scores = chain(outputs, scores)
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)

    return run


def hf_call(
    logits: torch.Tensor, settings: list[Setting], outputs: torch.Tensor
) -> Callable[[], object]:
    """One chain per kind of row, each on its own rows (gathered once, outside the timing)."""
    n = len(settings)
    parts = [hf_chain(logits[i::n], s, outputs[i::n]) for i, s in enumerate(settings)]
    return lambda: [part() for part in parts]


def per_call_ms(fn: Callable[[], object], iters: int, budget_s: float) -> float:
    """The median of ``iters`` calls after two warm-ups, fewer (at least 3) past ``budget_s``."""
    fn()
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < iters and (len(times) < 3 or spent < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times) * 1e3


def engine_share(batch: int, steps: int, g: torch.Generator) -> None:
    """The sampler's share of the engine's decode steps, per mix, beside HF's chain's."""
    from bench_engine import snapshot  # benchmarks/ is the script folder

    model = load_model(snapshot("bf16"), torch.device("cpu"), DTYPES["bf16"])
    vocab = model.config.vocab_size
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 160))
    engine = LLMEngine(model, torch.device("cpu"), config)
    engine.kv_cache.populated.wait()  # a replica past its first seconds (kv_memory.py)
    print(
        f"\nin the engine: SmolLM2-135M bf16, {batch} requests in flight, ~{PROMPT_TOKENS}-token "
        f"prompts, mean of {steps} decode steps; target: sampler <= "
        f"{STEP_SHARE_TARGET:.0%} of a step"
    )
    print(
        f"{'setting':<40} {'batch':>5} {'step ms':>8} {'sampler ms':>10} {'share':>6} "
        f"{'target':>6} {'HF ms':>8} {'HF share':>8}"
    )
    mixes = [(s.name, [s]) for s in SETTINGS] + [("mixed: greedy/top_k/top_p/min_p", MIXED)]
    for n, (name, settings) in enumerate(mixes):
        step_s, sampler_s = _decode_steps(engine, batch, settings, steps, vocab, f"m{n}")
        outputs = torch.randint(0, vocab, (batch, NUM_OUTPUT_TOKENS), generator=g)
        hf_s = (
            per_call_ms(
                hf_call(lm_like_logits(batch, vocab, g), settings[:batch], outputs), 10, 3.0
            )
            / 1e3
        )
        share = sampler_s / step_s
        hf_share = hf_s / (step_s - sampler_s + hf_s)
        verdict = "PASS" if share <= STEP_SHARE_TARGET else "FAIL"
        print(
            f"{name:<40} {batch:>5} {step_s * 1e3:>8.2f} {sampler_s * 1e3:>10.3f} "
            f"{share:>6.1%} {verdict:>6} {hf_s * 1e3:>8.2f} {hf_share:>8.1%}"
        )


def _decode_steps(
    engine: LLMEngine, batch: int, settings: list[Setting], steps: int, vocab: int, tag: str
) -> tuple[float, float]:
    """Mean wall time of a decode step with ``batch`` requests of these settings, and of the
    sampling inside it (prefill steps left out)."""
    g = torch.Generator().manual_seed(1)
    for i in range(batch):
        s = settings[i % len(settings)]
        params = SamplingParams(
            max_tokens=steps + 8, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
            min_p=s.min_p, presence_penalty=s.presence_penalty, ignore_eos=True,
        )  # fmt: skip
        prompt = torch.randint(100, vocab, (PROMPT_TOKENS + i % 8,), generator=g).tolist()
        engine.add_request(EngineRequest(f"{tag}-{i}", tuple(prompt), params, frozenset()))
    started: set[str] = set()
    while len(started) < batch:  # prefill: every request has its first token
        started.update(out.request_id for out in engine.step())
    runner = engine.runner
    step_total = sampler_total = 0.0
    for _ in range(steps):
        before = runner.sampler_seconds
        t0 = time.perf_counter()
        engine.step()
        step_total += time.perf_counter() - t0
        sampler_total += runner.sampler_seconds - before
    for i in range(batch):
        engine.abort(f"{tag}-{i}")
    return step_total / steps, sampler_total / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--logits", choices=["lm", "flat"], default="lm")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--engine-batch",
        type=int,
        nargs="+",
        default=[32],
        help="requests in flight in the engine table (0: no engine table)",
    )
    parser.add_argument("--engine-steps", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.logits} logits, "
        f"median of up to {args.iters} calls"
    )
    header = f"{'setting':<40} {'vocab':>6} {'batch':>5} {'hotpool ms':>10} {'GB/s':>6}"
    print(f"{header} {'+logprob ms':>11} {'+mask ms':>9} {'HF ms':>9} {'HF/hotpool':>10}")
    mixes = [(s.name, [s]) for s in SETTINGS] + [("mixed: greedy/top_k/top_p/min_p", MIXED)]
    for vocab in args.vocab:
        for name, settings in mixes:
            for batch in args.batch:
                if args.logits == "lm":
                    logits = lm_like_logits(batch, vocab, g)
                else:
                    logits = torch.randn(batch, vocab, generator=g)
                outputs = torch.randint(0, vocab, (batch, NUM_OUTPUT_TOKENS), generator=g)
                used = settings[:batch]  # a batch of one holds only the first kind
                ours = per_call_ms(
                    hotpool_call(logits, used, outputs, False), args.iters, args.budget
                )
                with_lp = per_call_ms(
                    hotpool_call(logits, used, outputs, True), args.iters, args.budget
                )
                mask = half_mask(batch, vocab, g)
                masked = per_call_ms(
                    hotpool_call(logits, used, outputs, False, mask), args.iters, args.budget
                )
                theirs = per_call_ms(hf_call(logits, used, outputs), args.iters, args.budget)
                gbps = logits.numel() * logits.element_size() / (ours * 1e-3) / 1e9
                print(
                    f"{name:<40} {vocab:>6} {batch:>5} {ours:>10.3f} {gbps:>6.2f} "
                    f"{with_lp:>11.3f} {masked:>9.3f} {theirs:>9.3f} {theirs / ours:>9.1f}x"
                )
    for batch in args.engine_batch:
        if batch > 0:
            engine_share(batch, args.engine_steps, g)


if __name__ == "__main__":
    main()
