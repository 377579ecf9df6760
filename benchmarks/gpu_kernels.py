"""GPU checks for the Triton sampler: its speed against the device's copy bandwidth, the
torch path and FlashInfer, in one table, then the kernel tests on CUDA.

    bash benchmarks/run_gpu_checks.sh [--sweep]  # the same as: python benchmarks/gpu_kernels.py

1. The table (below) first: it is what the device time is for.
2. For each shape and mix of rows, the median time (``triton.testing.do_bench``: CUDA events,
   warm-ups, the L2 cache flushed before each call) of
   - ``copy``: ``dst.copy_(logits)``; its bandwidth counts the bytes read and written;
   - ``kernel``: ``triton_sample`` alone, parameters already on the device, compiled without
     the filters for the mixes that have none (as ``sample`` asks); its GB/s is one read of
     the logits per call, the physical limit, compared with the copy bandwidth;
   - ``whole-row``: the same with ``slots=0``, every top_k and top_p search over the whole
     row instead of the row's candidates (the kernel before them), for the mixes that search;
   - ``sample``: ``sample(..., backend="triton")``, parameters uploaded and results copied to
     the host (what the engine pays);
   - ``torch``: ``sample(..., backend="torch")`` on the GPU (sorts top-p rows);
   - ``flashinfer``: ``flashinfer.sampling.top_k_top_p_sampling_from_logits`` when
     ``import flashinfer`` works, for the mixes it covers (temperature 1).
   The issue's target: at B=256, V=128256 the kernel reaches >= 70% of the copy bandwidth and
   is no slower than FlashInfer.
3. ``--sweep`` (before the table): the kernel's launch shape (tile width x warps) tried
   directly at B=256, V=128256 beside a plain row-sum kernel of the same shape (see
   ``sweep``); with ``--adopt`` the table and the tests then use the fastest.
4. ``pytest tests/kernels --noconftest`` in this process, with the sampling kernel already
   compiled for CUDA (imported before any test module, so nothing can turn it into the
   interpreter). A failure makes the exit status 1. ``--skip-tests`` skips this step.

Without CUDA it stops at once with a message and exit status 2. On a bare GPU machine
(``python3`` with torch, triton, pytest and hypothesis, nothing installed from here) it
imports ``hotpool`` straight from the checkout, each package from its pyproject folder.
With the device tool: ``run(command="bash benchmarks/run_gpu_checks.sh", timeout_s=540)``.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SHAPES = [(256, 128256), (64, 128256), (256, 32000), (32, 49152)]


@dataclass(frozen=True)
class Mix:
    name: str
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def filters(self) -> bool:  # what ``sample`` tells the kernel: whether to compile them in
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def flashinfer(self) -> bool:  # what top_k_top_p_sampling_from_logits computes
        return self.temperature == 1.0 and self.min_p == 0.0 and (self.top_k > 0 or self.top_p < 1)


MIXES = [
    Mix("greedy", temperature=0.0),
    Mix("T=1", temperature=1.0),
    Mix("T=0.7 top_k=50", temperature=0.7, top_k=50),
    Mix("top_p=0.9", top_p=0.9),
    Mix("top_k=50 top_p=0.9", top_k=50, top_p=0.9),
    Mix("min_p=0.05", min_p=0.05),
]


def import_hotpool() -> None:
    """``hotpool`` importable: installed, or else straight from this checkout, each package
    from the folder pyproject.toml maps it to, so a bare GPU machine needs no install."""
    try:
        import hotpool.kernels
        import hotpool.worker  # noqa: F401
    except ImportError:
        import tomllib

        project = tomllib.loads((REPO / "pyproject.toml").read_text())
        folders = project["tool"]["setuptools"]["package-dir"]
        for name in sorted(folders, key=lambda n: n.count(".")):  # parents first
            folder = REPO / folders[name]
            init = folder / "__init__.py"
            if init.exists():
                spec = importlib.util.spec_from_file_location(
                    name, init, submodule_search_locations=[str(folder)]
                )
            else:  # a namespace package (hotpool.platform)
                spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
                spec.submodule_search_locations = [str(folder)]
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            if spec.loader is not None:
                spec.loader.exec_module(module)
            if "." in name:
                parent, _, child = name.rpartition(".")
                setattr(sys.modules[parent], child, module)


def fail(message: str) -> None:
    print(f"gpu_kernels: {message}", file=sys.stderr)
    raise SystemExit(2)


def lm_like_logits(batch: int, vocab: int) -> torch.Tensor:
    """Rows that fall off like ``-a * log(rank)``, as a language model's do (see
    bench_sampling.py), in a random token order; fp32 on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(0)
    slope = torch.empty(batch, 1, device="cuda").uniform_(0.1, 1.1, generator=g).exp()
    ranks = torch.arange(1, vocab + 1, device="cuda", dtype=torch.float32)
    profile = -slope * ranks.log() + 0.3 * torch.randn(batch, vocab, device="cuda", generator=g)
    order = torch.rand(batch, vocab, device="cuda", generator=g).argsort(dim=1)
    return torch.empty_like(profile).scatter_(1, order, profile) + 10.0


def median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def flashinfer_call(
    logits: torch.Tensor, mix: Mix
) -> tuple[Callable[[], object] | None, str | None]:
    try:
        from flashinfer.sampling import top_k_top_p_sampling_from_logits
    except ImportError as e:
        return None, f"flashinfer does not import ({e}); its column is skipped"
    b, v = logits.shape
    top_k = torch.full((b,), mix.top_k or v, dtype=torch.int32, device="cuda")
    top_p = torch.full((b,), mix.top_p, dtype=torch.float32, device="cuda")

    def call() -> object:
        return top_k_top_p_sampling_from_logits(logits, top_k, top_p)

    try:
        call()
    except Exception as e:  # an API this script does not know: say so, keep the rest
        return None, f"flashinfer's top_k_top_p_sampling_from_logits failed: {e!r}"
    return call, None


def copy_gbps(logits: torch.Tensor) -> float:
    """The device's copy bandwidth on a tensor like ``logits``, bytes read and written."""
    dst = torch.empty_like(logits)
    return (
        2
        * logits.numel()
        * logits.element_size()
        / (median_ms(lambda: dst.copy_(logits)) * 1e-3)
        / 1e9
    )


def kernel_params(b: int, mix: Mix) -> tuple[torch.Tensor, ...]:
    """``triton_sample``'s per-row parameters for ``b`` rows of ``mix`` (seed 7, offset i)."""
    return (
        torch.full((b,), mix.temperature, device="cuda"),
        torch.full((b,), mix.top_k, dtype=torch.int32, device="cuda"),
        torch.full((b,), mix.top_p, device="cuda"),
        torch.full((b,), mix.min_p, device="cuda"),
        torch.full((b,), 7, dtype=torch.int64, device="cuda"),
        torch.arange(b, device="cuda"),
    )


def measure(logits: torch.Tensor, mix: Mix, copy: float, notes: set[str]) -> str:
    """One line of the table: ``mix`` on every row of ``logits``."""
    from hotpool.kernels.sampling import SamplingRow, sample
    from hotpool.kernels.triton_sampling import triton_sample

    b, v = logits.shape
    rows = [
        SamplingRow(
            temperature=mix.temperature,
            top_k=mix.top_k,
            top_p=mix.top_p,
            min_p=mix.min_p,
            seed=7,
            offset=i,
        )
        for i in range(b)
    ]
    params = kernel_params(b, mix)
    kernel_ms = median_ms(lambda: triton_sample(logits, *params, filters=mix.filters))
    whole = "n/a"
    if mix.top_k or mix.top_p < 1.0:
        whole = f"{median_ms(lambda: triton_sample(logits, *params, slots=0)) * 1e3:.1f}"
    sample_ms = median_ms(lambda: sample(logits, rows, backend="triton"))
    torch_ms = median_ms(lambda: sample(logits, rows, backend="torch"))
    fi = "n/a"
    if mix.flashinfer:
        call, note = flashinfer_call(logits, mix)
        if note:
            notes.add(note)
        if call is not None:
            fi = f"{median_ms(call) * 1e3:.1f}"
    gbps = logits.numel() * logits.element_size() / (kernel_ms * 1e-3) / 1e9
    return (
        f"{b:>4} {v:>7} {mix.name:<20} {copy:>9.0f} {kernel_ms * 1e3:>9.1f} {gbps:>7.0f} "
        f"{100 * gbps / copy:>5.0f}% {whole:>13} {sample_ms * 1e3:>9.1f} {torch_ms * 1e3:>9.1f} "
        f"{fi:>13}"
    )


def bench(shapes: list[tuple[int, int]], mixes: list[Mix]) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; medians, L2 flushed")
    head = f"{'B':>4} {'V':>7} {'mix':<20} {'copy GB/s':>9} {'kernel us':>9} {'GB/s':>7}"
    print(
        f"{head} {'% copy':>6} {'whole-row us':>13} {'sample us':>9} {'torch us':>9} "
        f"{'flashinfer us':>13}"
    )
    notes: set[str] = set()
    for b, v in shapes:
        logits = lm_like_logits(b, v)
        copy = copy_gbps(logits)
        for mix in mixes:
            print(measure(logits, mix, copy, notes))
    for note in sorted(notes):
        print(f"note: {note}")


SWEEP_MIXES = [MIXES[0], MIXES[1], MIXES[3], MIXES[4]]


@dataclass(frozen=True)
class Launch:
    """A launch shape of the sampling kernel: tile width, warps, load-ahead, and a cap on
    registers per thread (None: ptxas chooses; 64 at 512 threads fits two programs per SM)."""

    block: int
    warps: int
    prefetch: bool = True
    maxnreg: int | None = None

    def __str__(self) -> str:
        cap = "-" if self.maxnreg is None else str(self.maxnreg)
        return f"{self.block:>6} {self.warps:>5} {self.prefetch!s:>5} {cap:>6}"


# Load-ahead won at every width in the last sweep (docs/gpu_kernels.md); the candidates
# raised the full kernel's registers from 64 to 111 at 2048 x 16 (ptxas for sm_90 without a
# GPU; capped at 80: 120 bytes spilled, at 64: 328), so the capped shapes ask what two
# programs per SM buy and what the spills cost.
SWEEP_LAUNCHES = [
    Launch(1024, 16),
    Launch(2048, 8),
    Launch(2048, 16),
    Launch(2048, 16, maxnreg=64),
    Launch(2048, 16, maxnreg=80),
    Launch(2048, 16, prefetch=False),
    Launch(4096, 16),
]


def sweep(b: int = 256, v: int = 128256) -> Launch | None:
    """The kernel's launch shape, tried directly: tile width ``BLOCK`` x ``num_warps``, one
    row per program, against a plain row-sum kernel of the same shape (the most one program
    per row can read), with the kernel's registers and spills. Returns the shape with the
    least geometric-mean time over the mixes."""
    import math

    import triton
    import triton.language as tl

    from hotpool.kernels.triton_sampling import _GREEDY_BELOW, GPU_SLOTS, _sample_kernel

    @triton.jit
    def row_sum(x_ptr, out_ptr, V, BLOCK: tl.constexpr):
        base = x_ptr + tl.program_id(0).to(tl.int64) * V
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            acc += tl.load(base + idx, mask=idx < V, other=0.0)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))

    logits = lm_like_logits(b, v)
    out = torch.empty(b, device="cuda")
    tokens = torch.empty(b, dtype=torch.int64, device="cuda")
    logprobs = torch.empty(b, device="cuda")
    read_gb = logits.numel() * 4 / 1e9

    def row_sum_call(shape: Launch) -> Callable[[], object]:
        return lambda: row_sum[(b,)](logits, out, v, BLOCK=shape.block, num_warps=shape.warps)

    def sample_call(shape: Launch, mix: Mix) -> Callable[[], object]:
        p = kernel_params(b, mix)
        # As the wrapper chooses: no slots without filters.
        slots = min(GPU_SLOTS, triton.cdiv(v, shape.block)) if mix.filters else 0
        candidates = torch.empty(b, slots * shape.block, device="cuda")
        cap = {} if shape.maxnreg is None else {"maxnreg": shape.maxnreg}
        return lambda: _sample_kernel[(b,)](
            logits, logits.stride(0), *p, tokens, logprobs, candidates, b, v,
            GREEDY_BELOW=_GREEDY_BELOW, BLOCK=shape.block, ROWS=1, SLOTS=slots,
            PREFETCH=shape.prefetch, FILTERS=mix.filters, num_warps=shape.warps, **cap,
        )  # fmt: skip

    print(f"\nsweep at B={b}, V={v} fp32: us per call (GB/s as one read of the logits)")
    names = ["regs/spills", "row-sum", *(m.name for m in SWEEP_MIXES)]
    head = f"{'BLOCK':>6} {'warps':>5} {'ahead':>5} {'maxreg':>6} "
    print(head + " ".join(f"{n:>18}" for n in names))
    best: tuple[float, Launch | None] = (math.inf, None)
    for shape in SWEEP_LAUNCHES:
        cells = []
        try:
            compiled = sample_call(shape, SWEEP_MIXES[2])()  # with the filters compiled in
            regs = getattr(compiled, "n_regs", "?"), getattr(compiled, "n_spills", "?")
            cells.append(f"{regs[0]}/{regs[1]}")
            logs = []
            for call in (row_sum_call(shape), *(sample_call(shape, m) for m in SWEEP_MIXES)):
                ms = median_ms(call)
                cells.append(f"{ms * 1e3:.1f} ({read_gb / ms * 1e3:.0f})")
                logs.append(math.log(ms))
            best = min(best, (sum(logs[1:]) / len(SWEEP_MIXES), shape), key=lambda t: t[0])
        except Exception as e:  # a shape that does not compile: say so, go on
            cells.append(f"{type(e).__name__}: {e}"[:60])
        print(f"{shape} " + " ".join(f"{c:>18}" for c in cells))
    print(f"fastest over the mixes (geometric mean): {best[1]!r}")
    return best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    parser.add_argument("--sweep", action="store_true", help="first try other launch shapes")
    parser.add_argument(
        "--adopt", action="store_true", help="with --sweep: the table and tests use its best"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        fail("no CUDA device is visible to torch; these checks need a GPU")
    if os.environ.pop("TRITON_INTERPRET", None) not in (None, "0"):
        print("gpu_kernels: TRITON_INTERPRET was set; unset for this run", file=sys.stderr)
    import_hotpool()
    try:
        from hotpool.kernels import triton_sampling
    except ImportError as e:
        fail(f"triton does not import: {e}")
    if triton_sampling.interpreted():
        fail("the sampling kernel was decorated for the interpreter; run in a fresh process")
    # The numbers first: they are what the device time is for, and a test that hangs
    # cannot take them away.
    if args.sweep:
        best = sweep()
        if args.adopt and best is not None:
            triton_sampling.GPU_BLOCK, triton_sampling.GPU_WARPS = best.block, best.warps
            triton_sampling.GPU_PREFETCH = best.prefetch
            triton_sampling.GPU_MAXNREG = best.maxnreg
    ts = triton_sampling
    launch = (
        f"BLOCK={ts.GPU_BLOCK}, num_warps={ts.GPU_WARPS}, PREFETCH={ts.GPU_PREFETCH}, "
        f"maxnreg={ts.GPU_MAXNREG}"
    )
    print(f"\nthe wrapper launches {launch}")
    bench(SHAPES[:1] if args.quick else SHAPES, MIXES)
    if not args.skip_tests:
        import pytest

        # No conftest: the suite's root one needs the model-conversion packages, and the
        # kernels' own only chooses the interpreter where there is no GPU.
        tests = str(REPO / "tests" / "kernels")
        code = pytest.main(
            [tests, "-q", "--maxfail=5", "--durations=10", "--noconftest", "-p", "no:cacheprovider"]
        )
        if code != 0:
            print(f"gpu_kernels: kernel tests FAILED on CUDA (pytest exit {code})", file=sys.stderr)
            raise SystemExit(1)


if __name__ == "__main__":
    main()
