"""Speculative decoding's speed: hotpool's LLMEngine with n-gram speculation against the same
engine without it, on the same model, machine and prompts, in one run.

The model is the catalog's SmolLM2-135M-Instruct, a snapshot converted from its GGUF (cached
under ``.cache/bench``, where ``bench_engine.py`` keeps its own), prompted through its chat
template with greedy decoding and at most ``--max-tokens`` output tokens (EOS ends a request:
the counts are those produced). The prompts are input-grounded tasks, whose answers copy
long spans of the prompt, which is where prompt lookup has something to find: summarize a
~500-token passage, return a ~500-token passage with one word spelled differently, rename a
variable in ~400 tokens of Python (the answer opened with a code fence: ``ANSWER_STARTS``).
Three parts:

1. Single stream, per task: decode tok/s (after the first token: prefill is the same work
   either way) without and with speculation, their ratio, the acceptance rate (accepted
   over proposed tokens), tokens emitted per decode step, and a check that the speculative
   output equals the plain one token for token (greedy decoding: it must).
2. 32 requests in flight, the grounded prompts cycled: tok/s without and with speculation
   under the default automatic switch (``SpeculativeConfig().max_batch``), and how often
   the switch let a step speculate. Speculation should cost nothing here.
3. The crossover that sets ``DEFAULT_MAX_BATCH`` (``worker/protocol.py``):
   speculation always on (``max_batch=0``) against plain at each of ``--concurrency-levels``.

Exactness is checked where the schedule is the same: single streams, without prefix caching
(every run of a prompt, plain or speculative, must give the same tokens). Under load the
two runs batch differently, and in bf16 a request's sums depend on its batch (plain alone
gives the same prompt different greedy outputs at a near tie): parts 2 and 3 report how
many outputs differ, beside plain's own count, and do not fail on them.

Each engine runs a warm-up request first; each single-stream figure is the best of
``--repeats`` runs, plain and speculative alternating (a 2-core machine is noisy).

    python benchmarks/bench_spec.py                     # everything, k = 4
    python benchmarks/bench_spec.py --quick             # a smoke test: a minute or two
    python benchmarks/bench_spec.py --num-tokens 6 --no-sweep
    python benchmarks/bench_spec.py --concurrency-levels 1 2 3 4 6 8
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.models.loader import DTYPES, load_model
from hotpool.worker.protocol import (
    DEFAULT_MAX_BATCH,
    ChatMessage,
    SamplingParams,
    SpeculativeConfig,
)
from hotpool.worker.service import default_dtype
from hotpool.worker.snapshot.model_catalog import catalog_model
from hotpool.worker.snapshot.push import push_gguf
from hotpool.worker.tokenizer import TextTokenizer

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2"
PROSE = REPO / "tests" / "data" / "public_domain_prose.txt"
PASSAGE_TOKENS = 500  # the summarize task's slice of PROSE, cut at a paragraph's end
SINGLE_TARGET = 1.6
LOAD_TARGET = 0.97
LOAD_CONCURRENCY = 32

# The edit task's passage: original prose, British spellings of "colour" throughout.
COLOUR_PASSAGE = """\
The dyer's workshop stood at the bottom of the hill, where the river ran wide and slow. \
Every morning the dyer carried buckets of water up from the bank and set them beside the \
vats, and every morning the water came back out of the vats a different colour. On Monday \
it was the colour of rust, on Tuesday the colour of wet slate, and by Friday it had turned \
a deep and cheerful green that the children from the village came down to look at.

The dyer had learned the trade from his mother, who had learned it from hers. She used to \
say that a good colour was not made but coaxed. You could not force a colour into wool any \
more than you could force a cat into a basket. You had to warm the water slowly, stir it \
with patience, and wait for the colour to decide that it wanted to stay. If you hurried, \
the colour would wash out at the first rain, and the customer would come back angry with a \
grey coat that had once been blue.

Most of his colours came from plants. Onion skins gave a warm yellow, walnut husks a brown \
as dark as strong tea, and a weed that grew along the ditches gave a pale colour somewhere \
between lemon and straw. The rarest colour of all was a red that came from the roots of a \
small plant his mother had planted behind the house forty years before. He dug up only a \
few roots each autumn, so that the plant would never run out, and he saved that colour for \
the wedding cloth that the families in the valley ordered once or twice a year.

Visitors sometimes asked him which colour he liked best. He always gave the same answer: \
the next one. He meant that the colour he had not yet made was the one that interested him \
most, because he did not know exactly how it would turn out. The same recipe never gave the \
same colour twice. The weather, the water, the age of the roots and even the mood of the \
wool all played a part, and a colour that came out of the vat on a cold morning was never \
quite the colour that came out on a warm afternoon.

In the evening, when the light was low, he would hang the day's wool on long poles across \
the yard. The colours moved in the wind like flags, and the people walking home from the \
fields would stop at the gate to watch them dry.
"""

# The code task's program: original Python that uses the variable `total` throughout.
INVENTORY_CODE = '''\
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    count: int


def order_total(items, discount=0.0, tax_rate=0.2):
    """The price of an order: every item, less the discount, plus tax."""
    total = 0.0
    for item in items:
        if item.count <= 0:
            continue
        total += item.price * item.count
    if discount > 0:
        total = total * (1.0 - discount)
    total = total * (1.0 + tax_rate)
    return round(total, 2)


def cheapest_items(items, budget):
    """The names of the items that fit in the budget, cheapest first."""
    chosen = []
    total = 0.0
    for item in sorted(items, key=lambda item: item.price):
        if total + item.price > budget:
            break
        total += item.price
        chosen.append(item.name)
    return chosen, total


def restock_report(items, minimum=5):
    """A line for every item that runs low, and the cost of refilling them all."""
    lines = []
    total = 0.0
    for item in items:
        missing = minimum - item.count
        if missing > 0:
            cost = missing * item.price
            total += cost
            lines.append(f"{item.name}: order {missing} for {cost:.2f}")
    lines.append(f"total cost: {total:.2f}")
    return "\\n".join(lines)


if __name__ == "__main__":
    stock = [
        Item("pencil", 0.5, 12),
        Item("notebook", 2.25, 3),
        Item("eraser", 0.75, 0),
        Item("ruler", 1.5, 7),
    ]
    total = order_total(stock, discount=0.1)
    print("order:", total)
    names, total = cheapest_items(stock, budget=3.0)
    print("cheapest:", names, total)
    print(restock_report(stock))
'''

TASKS: dict[str, str] = {
    "summarize": "Summarize the following passage in a few sentences.\n\n{prose}",
    "edit": (
        "Return the following passage unchanged, word for word, except that every 'colour' "
        "is spelled 'color' (and 'colours' is spelled 'colors').\n\n" + COLOUR_PASSAGE
    ),
    "code": (
        "Rename the variable `total` to `running_sum` in this Python code. Return the whole "
        "code and nothing else.\n\n```python\n" + INVENTORY_CODE + "```"
    ),
}


@dataclass(frozen=True)
class Task:
    name: str
    prompt: list[int]


@dataclass
class Stream:
    """One request run alone to its end."""

    tokens: list[int]
    ttft_s: float
    decode_s: float  # from the first token to the last
    decode_steps: int  # steps after the first token's
    proposed: int
    accepted: int

    @property
    def decode_rate(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else math.nan


@dataclass
class Load:
    """Many requests, ``concurrency`` of them in flight."""

    tokens: int
    seconds: float
    steps: int
    spec_steps: int = 0  # steps in which some request verified proposals
    switch_on_steps: int = 0  # steps the switch left on (some hold no decode at all)
    switches: int = 0
    proposed: int = 0
    accepted: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)  # request -> its tokens

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def snapshot(dtype: str) -> Path:
    """The catalog model's snapshot in ``dtype`` (dense weights), where ``bench_engine.py``
    puts it: converted from the GGUF once (the tests' copy of the GGUF if present, else
    the bench's download), then reused."""
    from gguf_snapshots import gguf_file  # benchmarks/ is on sys.path when run as a script

    out = REPO / ".cache" / "bench" / "objects" / "snapshots" / f"{MODEL}-{dtype}"
    if not (out / "manifest.json").is_file():  # the manifest is written last
        push_gguf(gguf_file(MODEL), f"file://{out}", dtype, catalog_model(MODEL).chat)
    return out


def prose_slice(tok: TextTokenizer, limit: int) -> str:
    """The longest run of whole paragraphs of PROSE (after its title) within ``limit``
    tokens."""
    paragraphs = [p for p in PROSE.read_text().split("\n\n")[1:] if p.strip()]
    text = paragraphs[0]
    for p in paragraphs[1:]:
        longer = f"{text}\n\n{p}"
        if len(tok.encode(longer)) > limit:
            break
        text = longer
    return text


# Where the assistant's answer starts, as a client continuing the assistant's message sends
# it (code-editing tools open the fenced file themselves): asked for the renamed code alone,
# SmolLM2-135M describes the code instead, and a description is not grounded in the input.
ANSWER_STARTS = {"code": "```python\n"}


def build_tasks(tok: TextTokenizer) -> list[Task]:
    prose = prose_slice(tok, PASSAGE_TOKENS)
    tasks = []
    for name, text in TASKS.items():
        chat = [ChatMessage("user", text.replace("{prose}", prose))]
        start = ANSWER_STARTS.get(name)
        prompt = (
            tok.encode_chat(chat)
            if start is None
            else tok.encode(tok.apply_chat_template(chat) + start)
        )
        tasks.append(Task(name, prompt))
    return tasks


def kv_bytes(model: LlamaModel, concurrency: int, longest: int, max_tokens: int) -> int:
    """A KV budget that holds every request in flight at its longest, with room for the
    proposals and partial blocks, so no run preempts (which would time something else)."""
    cfg = model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    per_token *= model.embed.weight.element_size()
    return concurrency * (longest + max_tokens + 64) * per_token


def make_engine(
    model: LlamaModel,
    concurrency: int,
    kv: int,
    spec: SpeculativeConfig | None,
    prefix_caching: bool = True,
) -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=concurrency,
        kv_cache_bytes=kv,
        speculative=spec,
        enable_prefix_caching=prefix_caching,
    )
    engine = LLMEngine(model, torch.device("cpu"), config)
    engine.capture_decode_graphs()  # as the worker's cold start does (CPU: kernel programs)
    engine.kv_cache.populated.wait()  # a replica past its first second or two
    # Warm-up: a short grounded request (it speculates, too) runs every path once.
    warm = tuple(list(range(100, 140)) * 2)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    engine.add_request(EngineRequest("warm", warm, params, frozenset()))
    while engine.has_unfinished():
        engine.step()
    return engine


def run_stream(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, eos: frozenset[int], rid: str
) -> Stream:
    before = engine.stats()
    tokens: list[int] = []
    first = done = math.nan
    steps_with_tokens = 0
    t0 = time.perf_counter()
    engine.add_request(EngineRequest(rid, tuple(prompt), params, eos))
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                if not tokens:
                    first = time.perf_counter()
                tokens.extend(out.new_token_ids)
                steps_with_tokens += 1
            if out.finish_reason is not None:
                done = time.perf_counter()
    after = engine.stats()
    return Stream(
        tokens,
        first - t0,
        done - first,
        steps_with_tokens - 1,
        after.spec_proposed - before.spec_proposed,
        after.spec_accepted - before.spec_accepted,
    )


def run_load(
    engine: LLMEngine,
    prompts: list[list[int]],
    n: int,
    concurrency: int,
    params: SamplingParams,
    eos: frozenset[int],
    tag: str,
) -> Load:
    """``n`` requests, the prompts cycled, ``concurrency`` of them in flight."""
    before = engine.stats()
    switch = engine.spec_switch
    switches0 = switch.num_switches if switch is not None else 0
    load = Load(0, 0.0, 0)
    pending = list(range(n))
    in_flight = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i = pending.pop(0)
            p = prompts[i % len(prompts)]
            engine.add_request(EngineRequest(f"{tag}{i}", tuple(p), params, eos))
            load.outputs[i] = []
            in_flight += 1
        proposed = engine.stats().spec_proposed
        outs = engine.step()
        load.steps += 1
        # The switch is updated at the start of a step: its state now is the step's.
        load.switch_on_steps += switch is not None and switch.on
        load.spec_steps += engine.stats().spec_proposed > proposed
        for out in outs:
            load.outputs[int(out.request_id.removeprefix(tag))].extend(out.new_token_ids)
            load.tokens += len(out.new_token_ids)
            in_flight -= out.finish_reason is not None
    load.seconds = time.perf_counter() - t0
    after = engine.stats()
    load.proposed = after.spec_proposed - before.spec_proposed
    load.accepted = after.spec_accepted - before.spec_accepted
    load.switches = (switch.num_switches if switch is not None else 0) - switches0
    return load


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where ``a`` and ``b`` differ (-1: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def ratio_text(r: float, target: float) -> str:
    return f"{r:.2f}x {'PASS' if r >= target else 'FAIL'}"


def single_stream(
    model: LlamaModel, tok: TextTokenizer, tasks: list[Task], args: argparse.Namespace
) -> tuple[dict[str, float], list[str]]:
    """Part 1: each task alone, plain and speculative; (ratio per task, mismatches)."""
    eos = tok.eos_token_ids
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    longest = max(len(t.prompt) for t in tasks)
    kv = kv_bytes(model, 1, longest, args.max_tokens)
    # No prefix caching here: a prompt found cached computes only its tail, in other
    # kernels, whose bf16 sums may tip a near tie later on. Every run of a prompt then gives
    # the same tokens, and the exactness check tests speculation, not the cache.
    plain = make_engine(model, 1, kv, None, prefix_caching=False)
    spec = make_engine(
        model, 1, kv, SpeculativeConfig(num_tokens=args.num_tokens), prefix_caching=False
    )
    header = (
        f"{'task':<10} {'prompt':>6} {'out':>4} | {'plain tok/s':>11} {'ms/step':>7} | "
        f"{'spec tok/s':>10} {'ms/step':>7} {'accept':>6} {'tok/step':>8} | "
        f"{'ratio':>5} | {'same':>4}"
    )
    print(header)
    print("-" * len(header), flush=True)
    ratios: dict[str, float] = {}
    mismatches: list[str] = []
    samples: list[str] = []
    for task in tasks:
        best: dict[str, Stream] = {}
        runs: dict[str, list[Stream]] = {"plain": [], "spec": []}
        for r in range(args.repeats):
            for name, engine in (("plain", plain), ("spec", spec)):
                s = run_stream(engine, task.prompt, params, eos, f"{task.name}-{r}")
                runs[name].append(s)
                if name not in best or s.decode_rate > best[name].decode_rate:
                    best[name] = s
        p, s = best["plain"], best["spec"]
        # Every run of either engine must give the same tokens (the first plain run's).
        want = runs["plain"][0].tokens
        bad = [(n, i, x) for n in runs for i, x in enumerate(runs[n]) if x.tokens != want]
        same = "yes" if not bad else "NO"
        for n, i, x in bad:
            at = first_difference(want, x.tokens)
            mismatches.append(
                f"{task.name}: {n} run {i} differs from plain run 0 at token {at} "
                f"({len(x.tokens)} vs {len(want)} tokens)"
            )
        ratios[task.name] = s.decode_rate / p.decode_rate
        accept = s.accepted / s.proposed if s.proposed else math.nan
        per_step = (len(s.tokens) - 1) / max(s.decode_steps, 1)
        print(
            f"{task.name:<10} {len(task.prompt):>6} {len(p.tokens):>4} | "
            f"{p.decode_rate:>11.1f} {1e3 * p.decode_s / max(p.decode_steps, 1):>7.1f} | "
            f"{s.decode_rate:>10.1f} {1e3 * s.decode_s / max(s.decode_steps, 1):>7.1f} "
            f"{accept:>6.2f} {per_step:>8.2f} | {ratios[task.name]:>5.2f} | {same:>4}",
            flush=True,
        )
        text = tok.decode(want).replace("\n", " ")
        samples.append(f"  {task.name:<10} {text[:90]!r}{'...' if len(text) > 90 else ''}")
    print("outputs (the first 90 characters; a tiny model: copying is what it is asked for):")
    print("\n".join(samples))
    for m in mismatches:
        print(f"!!! MISMATCH: speculative greedy output differs from plain: {m}", flush=True)
    return ratios, mismatches


def under_load(
    model: LlamaModel,
    tok: TextTokenizer,
    tasks: list[Task],
    args: argparse.Namespace,
    spec: SpeculativeConfig,
    concurrency: int,
    n: int,
) -> tuple[Load, Load]:
    """Plain and speculative engines on the same ``n`` requests, ``concurrency`` in flight."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompts = [t.prompt for t in tasks]
    kv = kv_bytes(model, concurrency, max(map(len, prompts)), args.max_tokens)
    out = []
    for tag, config in (("p", None), ("s", spec)):
        engine = make_engine(model, concurrency, kv, config)
        out.append(run_load(engine, prompts, n, concurrency, params, tok.eos_token_ids, tag))
        del engine  # its KV cache goes before the next engine's is allocated
    return out[0], out[1]


def load_drift(plain: Load, spec: Load, prompts: int) -> str:
    """Under load the two runs batch differently (speculation changes when requests finish
    and others join), and a request's bf16 sums depend on its batch: the same prompt can
    part at a near tie. So this is reported, not checked (part 1 checks exactness): how
    many speculative outputs differ from plain's for the same request, beside how many of
    plain's own differ from its first output for the same prompt."""
    n = len(spec.outputs)
    differ = sum(toks != plain.outputs[i] for i, toks in spec.outputs.items())
    first = {i % prompts: plain.outputs[i] for i in sorted(plain.outputs, reverse=True)}
    own = sum(toks != first[i % prompts] for i, toks in plain.outputs.items())
    return (
        f"spec differs from plain in {differ}/{n} requests; plain alone gives {own}/{n} "
        "another output than its first request with the same prompt"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-tokens", type=int, default=4, help="k: tokens proposed per step")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128 (--quick: 32)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="single-stream runs per task and mode, the best kept (default 3, --quick: 1)",
    )
    ap.add_argument(
        "--load-requests",
        type=int,
        default=None,
        help=f"requests at concurrency {LOAD_CONCURRENCY} (default 64, --quick: 32)",
    )
    ap.add_argument(
        "--concurrency-levels",
        type=int,
        nargs="+",
        default=None,
        help="the crossover sweep's levels (default 1 2 4 8 16, --quick: 1 4)",
    )
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the sweep")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--quantization",
        choices=["none", "int8", "gguf"],
        default="none",
        help="the deployment's weights: dense (default), int8, or the GGUF's own blocks",
    )
    ap.add_argument(
        "--dtype",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="activations; auto (default): what a deployment of --quantization gets on this "
        "CPU (worker/service.py default_dtype)",
    )
    ap.add_argument("--quick", action="store_true", help="a much smaller run: a smoke test")
    args = ap.parse_args()
    quick = args.quick
    args.max_tokens = args.max_tokens or (32 if quick else 128)
    args.repeats = args.repeats or (1 if quick else 3)
    args.load_requests = args.load_requests or (LOAD_CONCURRENCY if quick else 2 * LOAD_CONCURRENCY)
    levels = args.concurrency_levels or ([1, 4] if quick else [1, 2, 4, 8, 16])
    torch.set_num_threads(args.threads)

    # The weights are stored in fp32 and cast at load: one snapshot serves both dtypes; the
    # GGUF's blocks come from bench_quant.py's snapshot (the same tokenizer and weights).
    model_dir = snapshot("fp32")
    cpu = torch.device("cpu")
    dtype = default_dtype(cpu, args.quantization) if args.dtype == "auto" else DTYPES[args.dtype]
    weights = model_dir
    if args.quantization == "gguf":
        from gguf_snapshots import blocks_snapshot, gguf_file  # benchmarks/ is on sys.path

        weights = blocks_snapshot(gguf_file(MODEL), MODEL)
    model = load_model(weights, cpu, dtype, quantization=args.quantization)
    tok = TextTokenizer(model_dir)
    tasks = build_tasks(tok)
    dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    print(
        f"{MODEL} {args.quantization} weights, {dtype_name} activations, {args.threads} "
        f"threads; n-gram speculation k={args.num_tokens}, "
        f"greedy, max_tokens={args.max_tokens} (EOS ends a request); default max_batch "
        f"{DEFAULT_MAX_BATCH}",
        flush=True,
    )

    print(f"\n1. single stream (decode tok/s after the first token, best of {args.repeats})")
    ratios, mismatches = single_stream(model, tok, tasks, args)

    auto = SpeculativeConfig(num_tokens=args.num_tokens)
    n = args.load_requests
    print(
        f"\n2. concurrency {LOAD_CONCURRENCY}, {n} requests (the tasks cycled), automatic "
        f"switch (max_batch={auto.max_batch}): end-to-end tok/s",
        flush=True,
    )
    plain, spec = under_load(model, tok, tasks, args, auto, LOAD_CONCURRENCY, n)
    load_ratio = spec.rate / plain.rate
    accept = spec.accepted / spec.proposed if spec.proposed else math.nan
    print(
        f"   plain {plain.rate:.1f} tok/s ({plain.tokens} tokens, {plain.seconds:.1f} s, "
        f"{plain.steps} steps)"
    )
    print(
        f"   spec  {spec.rate:.1f} tok/s ({spec.tokens} tokens, {spec.seconds:.1f} s, "
        f"{spec.steps} steps)  ratio {load_ratio:.2f}"
    )
    print(
        f"   switch on in {spec.switch_on_steps}/{spec.steps} steps, proposals verified in "
        f"{spec.spec_steps} steps, {spec.switches} switches; {spec.proposed} proposed, "
        f"{spec.accepted} accepted ({accept:.2f})",
        flush=True,
    )
    print(f"   outputs (batch-dependent in bf16): {load_drift(plain, spec, len(tasks))}")

    if args.sweep:
        always = SpeculativeConfig(num_tokens=args.num_tokens, max_batch=0)
        print(
            "\n3. crossover: speculation always on (max_batch=0) vs plain, 2 x c requests "
            "(the tasks cycled), end-to-end tok/s",
            flush=True,
        )
        header = f"{'conc':>4} {'reqs':>4} | {'plain tok/s':>11} | {'spec tok/s':>10} "
        header += f"{'accept':>6} | {'ratio':>5}"
        print(header)
        print("-" * len(header), flush=True)
        drift: list[str] = []
        for c in levels:
            p, s = under_load(model, tok, tasks, args, always, c, 2 * c)
            acc = s.accepted / s.proposed if s.proposed else math.nan
            print(
                f"{c:>4} {2 * c:>4} | {p.rate:>11.1f} | {s.rate:>10.1f} {acc:>6.2f} | "
                f"{s.rate / p.rate:>5.2f}",
                flush=True,
            )
            drift.append(f"c={c}: {load_drift(p, s, len(tasks))}")
        print("outputs (batch-dependent in bf16):\n" + "\n".join(f"  {d}" for d in drift))

    print("\ntargets")
    geo = math.exp(sum(map(math.log, ratios.values())) / len(ratios))
    each = ", ".join(f"{name} {r:.2f}x" for name, r in ratios.items())
    print(
        f"  >= {SINGLE_TARGET}x single-stream on every grounded task: {each} (geomean "
        f"{geo:.2f}x) -> {'PASS' if min(ratios.values()) >= SINGLE_TARGET else 'FAIL'}"
    )
    print(f"  >= {LOAD_TARGET}x at c={LOAD_CONCURRENCY}: {ratio_text(load_ratio, LOAD_TARGET)}")
    if mismatches:
        print(f"  !!! greedy equality: FAIL, {len(mismatches)} output(s) differ:")
        for m in mismatches:
            print(f"      {m}")
        return 1
    print("  greedy equality (single streams: speculative output == plain, every run): PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
