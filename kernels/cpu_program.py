"""Kernel programs: a forward pass's C kernel calls, recorded once and replayed in one call.

This is the CPU's CUDA graph. A decode step of a small model makes ~300 calls into the C
kernels of :mod:`cpu_ops` and :mod:`quant_ops` (norms, RoPE, KV writes, attention, linears),
and on the CPU the Python around each call (argument checks, ctypes, allocating the
output) costs more than many of the kernels themselves: about half of SmolLM2-135M's
single-stream step. :class:`ProgramRecorder` runs a forward pass normally while noting
every kernel call, its C function and its arguments; :class:`KernelProgram` then replays
the calls from C (``cpu_program.c``) with the GIL released, against the same buffers.

What makes a replay valid is what makes a CUDA graph valid, and the recorder checks it:

- **Every computation is a recorded kernel.** A torch op that computes (an add, a copy, an
  index) would not be replayed, so while recording, a dispatch mode lets through only
  allocations and views that alias their input; anything else marks the recording failed
  (:attr:`ProgramRecorder.failure`), and the caller runs eagerly instead. A model whose
  forward is not wholly native (fp32 torch ops, Gemma's scaled embedding, a MoE's routing)
  is found out on its first recording.
- **Static buffers.** Inputs that change per step (token ids, positions, slots, block
  tables, lengths) are read by the kernels from fixed tensors that the caller refills
  before each replay (``decode_graphs.DecodeGraphs``); every tensor allocated while
  recording (the activations) is kept alive by the program, so its pointers stay valid.
- **No host decisions on data.** Reading a tensor's value on the host is itself a torch op
  (``item``), caught above; shapes are fixed per recorded batch size.

Each replay writes the same output tensor: the caller copies or consumes it before the
next replay, as with a CUDA graph's output. Weights must not move while a program lives.

Recording runs where the calls can be replayed exactly: Linux on x86-64 or AArch64 (see
``cpu_program.c`` for the calling convention it relies on).
"""

from __future__ import annotations

import ctypes
import platform
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hotpool.kernels import cpu_ops, quant_ops

MAX_INTS = 20  # cpu_program.c's HP_PROGRAM_INTS
MAX_FLOATS = 2

# torch ops a recorded forward may run: they allocate, or give a view of an input.
_ALLOCATIONS = frozenset(
    ("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted")
)

# In place on a tensor's autograd metadata, not its data (``torch.tensor(constant)``).
_METADATA = frozenset(("detach_",))


class _Op(ctypes.Structure):
    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("n_int", ctypes.c_int64),
        ("n_float", ctypes.c_int64),
        ("check", ctypes.c_int64),
        ("a", ctypes.c_int64 * MAX_INTS),
        ("f", ctypes.c_float * MAX_FLOATS),
    ]


def supported() -> bool:
    """Whether programs can be recorded and replayed here (platform and kernels)."""
    return (
        platform.system() == "Linux"
        and platform.machine() in ("x86_64", "aarch64")
        and cpu_ops.load() is not None
    )


@dataclass(frozen=True)
class RecordedCall:
    """One kernel call: the C function's address and name, its integer and pointer
    arguments, then its float ones, and whether its int result is an error code."""

    name: str
    address: int
    ints: tuple[int, ...]
    floats: tuple[float, ...]
    checked: bool


class KernelProgram:
    """Recorded calls, replayed in order by :meth:`run` (one C call, GIL released)."""

    def __init__(self, calls: list[RecordedCall], keep: list[torch.Tensor]) -> None:
        kernels = cpu_ops.load()
        if kernels is None:
            raise RuntimeError("the CPU kernels are unavailable: no program can run")
        lib = kernels._lib
        if lib.hp_op_size() != ctypes.sizeof(_Op):
            raise RuntimeError("cpu_program.c's op layout differs from cpu_program.py's")
        self.calls = calls
        self._keep = keep  # the activations the calls' pointers refer to
        self._ops = (_Op * len(calls))()
        for op, call in zip(self._ops, calls, strict=True):
            op.fn = call.address
            op.n_int, op.n_float, op.check = len(call.ints), len(call.floats), int(call.checked)
            op.a[: len(call.ints)] = call.ints
            op.f[: len(call.floats)] = call.floats
        self._run = lib.hp_run_program
        self._code = ctypes.c_int64(0)
        self._code_ptr = ctypes.addressof(self._code)

    def __len__(self) -> int:
        return len(self.calls)

    def run(self) -> None:
        """Replay every call. A kernel that reports an error stops the program and raises
        as its eager wrapper would (IndexError for a token outside the vocabulary,
        MemoryError when a kernel's buffers cannot be allocated)."""
        failed = self._run(ctypes.addressof(self._ops), len(self.calls), self._code_ptr)
        if failed >= 0:
            call, code = self.calls[failed], self._code.value
            if call.name == "hp_embed":
                raise IndexError(f"{code} token id(s) outside the vocabulary")
            if code == -2:  # hq_linear's, hp_linear's and hp_gate_up's
                raise MemoryError(f"{call.name}: out of memory for the kernel's buffers")
            raise RuntimeError(f"kernel {call.name} failed with code {code}")


class ProgramRecorder:
    """Records the kernel calls the current thread makes inside ``with``, while they run.

    After the block, :attr:`failure` says why the calls do not make a program (None when
    they do) and :meth:`program` builds it. The forward pass inside runs normally either way:
    its results are those of an eager pass."""

    def __init__(self) -> None:
        self.calls: list[RecordedCall] = []
        self.failure: str | None = None if supported() else "not supported on this platform"
        self._keep: list[torch.Tensor] = []
        self._thread = threading.get_ident()

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason

    def program(self) -> KernelProgram:
        if self.failure is not None:
            raise RuntimeError(f"no program: {self.failure}")
        if not self.calls:
            raise RuntimeError("no program: no kernel was called")
        return KernelProgram(self.calls, self._keep)

    def __enter__(self) -> ProgramRecorder:
        self._stack = _recording(self)
        self._stack.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.__exit__(*exc)

    # --- called by the recording proxies and the dispatch mode -------------------------------

    def note(self, name: str, fn: Any, args: tuple[Any, ...]) -> None:
        if threading.get_ident() != self._thread:
            return  # another thread's kernels are not this forward's
        ints: list[int] = []
        floats: list[float] = []
        for kind, value in zip(fn.argtypes, args, strict=True):
            if kind is ctypes.c_float:
                floats.append(float(value))
            elif floats:
                self.fail(f"{name} takes an integer after a float")
                return
            else:
                ints.append(0 if value is None else int(value))
        if len(ints) > MAX_INTS or len(floats) > MAX_FLOATS:
            self.fail(f"{name} takes more arguments than a program op holds")
            return
        address = ctypes.cast(fn, ctypes.c_void_p).value or 0
        self.calls.append(
            RecordedCall(name, address, tuple(ints), tuple(floats), fn.restype is not None)
        )

    def saw(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        name = func.overloadpacket.__name__
        if name in _ALLOCATIONS:
            self._keep.extend(t for t in _tensors(out))
            return
        if name in _METADATA:
            return
        schema = func._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        inputs = {s for t in _tensors(args) if (s := _storage(t)) is not None}
        outputs = list(_tensors(out))
        if not writes and outputs and all(_storage(t) in inputs for t in outputs):
            return  # a view: no computation
        self.fail(f"torch op {func} computes outside the kernels")


class _RecordingLib:
    """A kernel library whose functions also report each call to the recorder."""

    def __init__(self, lib: ctypes.CDLL, recorder: ProgramRecorder) -> None:
        self._lib = lib
        self._recorder = recorder

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self._lib, name)
        recorder = self._recorder

        def call(*args: Any) -> Any:
            result = fn(*args)
            recorder.note(name, fn, args)
            return result

        return call


class _Guard(TorchDispatchMode):
    def __init__(self, recorder: ProgramRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.recorder.saw(func, (args, kwargs), out)
        return out


@contextmanager
def _recording(recorder: ProgramRecorder) -> Iterator[None]:
    """Swap the process's kernel libraries for recording ones and watch torch's ops; both
    restored on exit."""
    holders = [h for h in (cpu_ops.load(), quant_ops.load()) if h is not None]
    real = [h._lib for h in holders]
    for holder, lib in zip(holders, real, strict=True):
        holder._lib = _RecordingLib(lib, recorder)  # type: ignore[assignment]
    try:
        with _Guard(recorder):
            yield
    finally:
        for holder, lib in zip(holders, real, strict=True):
            holder._lib = lib


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for a tensor that has none to show (oneDNN's
    opaque packed weights), whose op is then never taken for a view."""
    if t.is_mkldnn:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
