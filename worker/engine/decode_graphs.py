"""Decode steps replayed as CUDA graphs: one launch for the whole forward pass.

A small model's decode step on a GPU is bound by launching kernels, not by reading weights:
SmolLM2 (30 layers) launches some 400 kernels a step, and Python dispatching them takes
~16 ms where the weights take ~0.1 ms to read on an H200 (``benchmarks/gpu_serving.py``).
vLLM and SGLang capture the decode forward once per batch size of a ladder and replay it;
so does this module.

- **Static inputs.** One set of device buffers, as large as the largest batch: token ids,
  positions, sequence lengths and each layer group's slot mapping (``vec``), and each
  group's block tables (``tables``, as wide as ``max_model_len`` needs). A graph of batch
  size ``b`` is captured over their first ``b`` rows; a step copies its inputs into them
  (two host-to-device copies) and replays.
- **Padding.** A batch of ``n`` decodes runs in the smallest captured size ``b >= n``. The
  ``b - n`` padding rows decode token 0 at position 0 over one key of a *scratch block*: a
  KV block that the engine allocates beyond the block pool's and never hands out, so their
  KV writes land where no sequence reads. Their logits are dropped.
- **What is captured.** The model's forward and the LM head (fp32 logits of every row).
  Sampling, grammar masks and logprobs run eagerly on the replayed logits, as before.
- **Speculative steps.** A request verifying ``k`` proposals is ``k + 1`` rows of the
  batch, one per position, each attending to the keys up to its own (the model runner
  builds them): verification replays the same graphs as plain decoding.
- **Eager steps.** Steps with a prefill chunk, and batches of more rows than the largest
  size, run eagerly; so do mixture-of-experts models (their routing reads expert counts on the
  host) and any model on the CPU unless asked (``capture=False``, below).
- **Memory.** Graphs share one memory pool, captured largest first so the smaller ones
  reuse its blocks; each holds its logits output (``b x vocab`` fp32).

On the CPU the same runner records **kernel programs** instead (``programs=True``,
:mod:`hotpool.kernels.cpu_program`): the first step at a batch size runs the forward while
recording its C kernel calls, and later steps at that size replay them from C in one call,
without the Python around each kernel (half of a small model's single-stream step). It
needs a forward made wholly of the native kernels (bf16 with hotpool's C ops; linears
packed or quantized); anything else is found out by the first recording, which is logged,
and the engine then runs every step eagerly. CPU batches are padded less (a padding row
costs compute there): ``CPU_LADDER``, up to 32 rows; larger batches run eagerly, where the
Python is a small share of the step. Each size's program keeps its activations and logits
alive (about 0.5 MB a row for SmolLM2-135M), recorded only when a batch of that size runs.

With ``capture=False`` and no program, every "replay" runs the forward over the static
buffers eagerly. Tests use it to hold padding, buffer reuse and the choice of size to the
eager path's output; the CUDA capture itself runs in the GPU script.

``HOTPOOL_CUDA_GRAPHS=0`` turns CUDA graphs off, ``HOTPOOL_CPU_PROGRAMS=0`` kernel programs
(the engine then runs every step eagerly).
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hotpool.kernels import cpu_program
from hotpool.kernels.paged_attention import decode_key_bias
from hotpool.worker.models.attention import (
    AttentionKernels,
    PagedAttention,
    PagedAttentionMetadata,
    PagedKVCache,
)
from hotpool.worker.models.llama import LlamaModel

log = logging.getLogger(__name__)

GRAPHS_ENV = "HOTPOOL_CUDA_GRAPHS"
PROGRAMS_ENV = "HOTPOOL_CPU_PROGRAMS"
# Batch sizes captured: at most 1.5x padding between neighbours, few enough graphs that
# capture stays within the cold start's warm-up (each is one forward pass).
LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Kernel programs' sizes on the CPU: a padding row costs its share of compute there, so
# steps of at most 1.5x (at most one row up to 4).
CPU_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def graph_batch_sizes(max_num_seqs: int, ladder: Sequence[int] = LADDER) -> tuple[int, ...]:
    """The sizes to capture: the ladder up to the first size that holds ``max_num_seqs``
    decodes (so every decode batch the scheduler can form has a graph), or the whole ladder
    where it is smaller."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    i = bisect.bisect_left(ladder, max_num_seqs)
    return tuple(ladder[: i + 1])


def cpu_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Kernel programs' sizes: :data:`CPU_LADDER` up to ``max_num_seqs`` (larger batches
    run eagerly)."""
    return graph_batch_sizes(max_num_seqs, CPU_LADDER)


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``n`` rows; None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def graphs_wanted(
    device: torch.device, model: LlamaModel, env: Mapping[str, str] | None = None
) -> bool:
    """Whether decode steps should replay graphs: CUDA graphs on CUDA, unless
    ``HOTPOOL_CUDA_GRAPHS=0``; kernel programs on the CPU for bf16 models on the native
    kernels, unless ``HOTPOOL_CPU_PROGRAMS=0``. Dense models only."""
    env = os.environ if env is None else env
    if model.config.moe is not None:
        return False
    if device.type == "cuda":
        return not _off(env.get(GRAPHS_ENV, "1"))
    return (
        device.type == "cpu"
        and not _off(env.get(PROGRAMS_ENV, "1"))
        and model.native_ops
        and model.embed.weight.dtype == torch.bfloat16
        and cpu_program.supported()
    )


def _off(value: str) -> bool:
    return value.strip().lower() in ("0", "false", "no", "off")


@dataclass(frozen=True)
class DecodeRow:
    """One decoding sequence's inputs: its token at ``position`` (``seq_len = position + 1``
    keys, itself included), and per layer group its slot and block table."""

    token_id: int
    position: int
    slots: tuple[int, ...]  # per layer group
    tables: tuple[Sequence[int], ...]  # per layer group: block ids


class DecodeGraphs:
    """Static-buffer decode forwards, one per batch size, captured as CUDA graphs when
    ``capture``, recorded as kernel programs when ``programs`` (see the module). Where a
    program cannot be recorded, steps replay eagerly over the buffers if
    ``eager_replays``, else the runner stops taking steps (:meth:`fits`)."""

    def __init__(
        self,
        model: LlamaModel,
        kv: PagedKVCache,
        kernels: AttentionKernels,
        layer_group: tuple[int, ...],
        num_groups: int,
        max_model_len: int,
        scratch_block: int,
        sizes: Sequence[int],
        capture: bool,
        programs: bool = False,
        eager_replays: bool = True,
    ) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"sizes must be ascending positive batch sizes, got {list(sizes)}")
        if not 0 <= scratch_block < kv.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not in the cache")
        self.model = model
        self.kv = kv
        self.kernels = kernels
        self.layer_group = layer_group
        self.num_groups = num_groups
        self.sizes = tuple(sizes)
        self.capture_graphs = capture
        self.programs = programs and not capture
        self.eager_replays = eager_replays
        # Why no program could be recorded (logged once); None while they can be.
        self.program_failure: str | None = None
        self._programs: dict[int, cpu_program.KernelProgram] = {}
        # Size -> a program replay's seconds (EWMA): what a row more costs (row_cost).
        self._seconds: dict[int, float] = {}
        self.scratch_block = scratch_block
        bs = kv.block_size
        self.max_blocks = -(-max_model_len // bs)
        dev = kv.k[0].device
        big = self.sizes[-1]
        # Rows: token ids, positions, sequence lengths, then one slot mapping per group.
        self.vec = torch.zeros(3 + num_groups, big, dtype=torch.long, device=dev)
        self.tables = torch.zeros(num_groups, big, self.max_blocks, dtype=torch.long, device=dev)
        self._pad_rows(big)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.replays = 0  # steps run through this runner (a metric for tests and benchmarks)

    @property
    def replayed(self) -> bool:
        """Whether steps replay captured graphs or recorded programs (not the eager forward
        over the buffers): each row then costs only its kernels' share."""
        return self.capture_graphs or self.programs

    def row_cost(self) -> float | None:
        """What each row past the first adds to a replayed program step, as a share of a
        one-row step, from the replays measured so far (the smallest larger size's); None
        until size 1 and a larger one have replayed. Bandwidth-bound kernels add little
        (SmolLM2 bf16 here: 7% a row), compute-bound ones more (its Q4_1 on AVX2)."""
        one = self._seconds.get(1)
        more = [b for b in self._seconds if b > 1]
        if one is None or not more:
            return None
        b = min(more)
        return max(0.0, (self._seconds[b] - one) / ((b - 1) * one))

    def fits(self, n: int, width: int) -> bool:
        """Whether ``n`` decodes whose longest block table has ``width`` blocks run here."""
        if self.program_failure is not None and not self.eager_replays:
            return False
        return 1 <= n <= self.sizes[-1] and width <= self.max_blocks

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size (largest first, in one memory pool); the seconds it took. With
        ``capture=False`` it only runs each size once (what a capture would compile); kernel
        programs are recorded later, by each size's first step."""
        if self.programs:
            return 0.0
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None
        for b in reversed(self.sizes):
            self._pad_rows(b)
            if not self.capture_graphs:
                self._forward(b)
                continue
            # A warm-up run on a side stream first, as PyTorch advises: lazy initialization
            # (cuBLAS workspaces, Triton's first launch) must not happen inside the capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[b] = self._forward(b)
            self._graphs[b] = graph
        if self.capture_graphs:
            torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    @torch.inference_mode()
    def run(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` fp32 of one decode step (KV written as the eager
        step writes it). Raises ValueError when the rows do not fit (:meth:`fits`)."""
        n = len(rows)
        width = max(len(t) for r in rows for t in r.tables)
        b = padded_size(n, self.sizes)
        if b is None or not self.fits(n, width):
            raise ValueError(f"{n} decodes of up to {width} blocks do not fit the graphs")
        self._load(rows, b, width)
        self.replays += 1
        if self.programs:
            return self._program_step(b)[:n]
        graph = self._graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        graph.replay()
        return self._logits[b][:n]

    def _program_step(self, b: int) -> torch.Tensor:
        """Size ``b``'s logits from its kernel program, recording it on its first step."""
        program = self._programs.get(b)
        if program is not None:
            t0 = time.perf_counter()
            program.run()
            took = time.perf_counter() - t0
            last = self._seconds.get(b)
            self._seconds[b] = took if last is None else last + 0.2 * (took - last)
            return self._logits[b]
        with cpu_program.ProgramRecorder() as recorder:
            logits = self._forward(b)
        if recorder.failure is None:
            self._programs[b] = recorder.program()
            self._logits[b] = logits
        else:
            self.programs = False
            self.program_failure = recorder.failure
            log.info("decode steps run eagerly: no kernel program (%s)", recorder.failure)
        return logits

    def _load(self, rows: Sequence[DecodeRow], b: int, width: int) -> None:
        g = self.num_groups
        scratch_slot = self.scratch_block * self.kv.block_size
        pad = b - len(rows)
        vec = [
            [r.token_id for r in rows] + [0] * pad,
            [r.position for r in rows] + [0] * pad,
            [r.position + 1 for r in rows] + [1] * pad,
            *([r.slots[i] for r in rows] + [scratch_slot] * pad for i in range(g)),
        ]
        self.vec[:, :b].copy_(torch.tensor(vec, dtype=torch.long))
        pad_table = [self.scratch_block] + [0] * (width - 1)
        tables = [
            [list(r.tables[i]) + [0] * (width - len(r.tables[i])) for r in rows] + [pad_table] * pad
            for i in range(g)
        ]
        self.tables[:, :b, :width].copy_(torch.tensor(tables, dtype=torch.long))

    def _pad_rows(self, b: int) -> None:
        """The first ``b`` rows as padding (see the module): what a capture runs on."""
        self.vec[:, :b] = 0
        self.vec[2, :b] = 1
        self.vec[3:, :b] = self.scratch_block * self.kv.block_size
        self.tables[:, :b] = 0
        self.tables[:, :b, 0] = self.scratch_block

    def _forward(self, b: int) -> torch.Tensor:
        seq_lens = self.vec[2, :b]
        bias = None
        if self.kernels.needs_key_bias:  # the torch kernels (CPU): no host sync in it either
            bias = decode_key_bias(seq_lens, self.max_blocks * self.kv.block_size)
        metas = [
            PagedAttentionMetadata(self.vec[3 + i, :b], b, self.tables[i, :b], seq_lens, bias, ())
            for i in range(self.num_groups)
        ]
        attn = PagedAttention(self.kv, metas, self.kernels, self.layer_group)
        hidden = self.model(self.vec[0, :b], self.vec[1, :b], attn)
        return self.model.logits(hidden)
