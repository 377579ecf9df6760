"""Quantized weights of a linear layer, as typed values: what a layer's bytes mean.

A weight ``W [n, k]`` (``n`` output features, ``k`` input features, nn.Linear's order) is
one of:

- :class:`Int8Weight`: ``q`` int8 ``[n, k]`` and ``scale`` float32, ``W = q * scale``, with one
  scale per output feature (``[n]``, what :func:`quantize_int8` makes) or per group of
  columns (``[n, k / g]``, GGUF Q8_0 repacked for the GPU).
- :class:`GgufWeight`: GGUF's own blocks, byte for byte as a ``.gguf`` file stores them, one
  row of blocks per output feature (``uint8 [n, row_bytes]``): Q8_0, Q4_0, Q4_1, Q4_K.
- :class:`InterleavedWeight`: GGUF Q8_0 / Q4_0 / Q4_1 blocks reordered so that 16 output
  features' blocks of the same columns lie together (the CPU kernels' layout on AMX
  machines; :mod:`hotpool.kernels.quant_interleave` makes and undoes it): the same bytes.
- :class:`Int4Weight`: two nibbles a byte (``uint8 [n, k / 2]``, column ``2 i`` in the low
  nibble of byte ``i``, ``2 i + 1`` in the high one) and float32 scales ``[n, k / g]`` per
  group of ``g`` columns: ``W = (q - 8) * scale``, or ``q * scale + minimum`` where there is
  a minimum. The Triton kernels' layout (a repack of GGUF's Q4 blocks, or
  :func:`quantize_int4`).

Every constructor checks dtypes and shapes and raises ValueError naming the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Self

import numpy as np
import torch


class GgufKind(IntEnum):
    """The GGUF block types served as they are; values are ggml's (GGMLQuantizationType)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12

    @property
    def block_size(self) -> int:
        """Weights per block (columns of one row)."""
        return 256 if self is GgufKind.Q4_K else 32

    @property
    def block_bytes(self) -> int:
        return {GgufKind.Q4_0: 18, GgufKind.Q4_1: 20, GgufKind.Q8_0: 34, GgufKind.Q4_K: 144}[self]

    def row_bytes(self, k: int) -> int:
        return k // self.block_size * self.block_bytes


INT4_GROUP_SIZES = (32, 64, 128)


def _check_2d(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_k(k: int, block: int, what: str) -> None:
    if k <= 0 or k % block:
        raise ValueError(f"k = {k} is not a positive multiple of {what}'s block of {block}")


@dataclass(frozen=True)
class Int8Weight:
    """``W = q * scale``: ``scale`` float32 ``[n]`` (per output feature) or ``[n, k / g]``."""

    q: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.q.dim() != 2:
            raise ValueError(f"q must be 2-D [n, k], got {list(self.q.shape)}")
        n, k = self.q.shape
        _check_2d(self.q, "q", torch.int8, (n, k))
        groups = 1 if self.scale.dim() == 1 else self.scale.shape[-1]
        if self.scale.dim() not in (1, 2) or groups <= 0 or k % groups:
            raise ValueError(f"scale must be [{n}] or [{n}, k / g], got {list(self.scale.shape)}")
        expected = (n,) if self.scale.dim() == 1 else (n, groups)
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != expected:
            raise ValueError(f"scale must be float32 {list(expected)}, got {self.scale.dtype}")
        if not self.scale.is_contiguous() or self.scale.device != self.q.device:
            raise ValueError("scale must be contiguous and on q's device")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def group_size(self) -> int:
        """Columns sharing a scale (k for one scale per output feature)."""
        return self.shape[1] // (1 if self.scale.dim() == 1 else self.scale.shape[1])

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def to(self, device: torch.device | str) -> Int8Weight:
        return Int8Weight(self.q.to(device), self.scale.to(device))


@dataclass(frozen=True)
class _Blocks:
    """GGUF blocks of a weight of ``shape`` ``(n, k)`` in some order (the subclasses)."""

    kind: GgufKind
    data: torch.Tensor
    shape: tuple[int, int]

    def _check(self, block: int, data_shape: tuple[int, int]) -> None:
        """``k`` a whole number of ``block`` columns and ``data`` ``uint8 data_shape``."""
        n, k = self.shape
        if n <= 0:
            raise ValueError(f"a weight needs at least one output feature, got n = {n}")
        _check_k(k, block, self.kind.name)
        _check_2d(self.data, "data", torch.uint8, data_shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def to(self, device: torch.device | str) -> Self:
        return type(self)(self.kind, self.data.to(device), self.shape)


@dataclass(frozen=True)
class GgufWeight(_Blocks):
    """GGUF blocks ``uint8 [n, kind.row_bytes(k)]`` of a weight of ``shape`` ``(n, k)``."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GgufKind):
            raise ValueError(f"kind must be a GgufKind, got {self.kind!r}")
        n, k = self.shape
        self._check(self.kind.block_size, (n, self.kind.row_bytes(k)))


@dataclass(frozen=True)
class Int4Weight:
    """Packed nibbles ``uint8 [n, k / 2]``, float32 ``scale`` ``[n, k / group_size]`` and,
    for the asymmetric form, ``minimum`` of the same shape (None: symmetric, ``q - 8``)."""

    packed: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    group_size: int

    def __post_init__(self) -> None:
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
        if self.packed.dim() != 2:
            raise ValueError(f"packed must be 2-D [n, k / 2], got {list(self.packed.shape)}")
        n, k = self.shape
        _check_k(k, self.group_size, "int4")
        _check_2d(self.packed, "packed", torch.uint8, (n, k // 2))
        groups = (n, k // self.group_size)
        _check_2d(self.scale, "scale", torch.float32, groups)
        if self.minimum is not None:
            _check_2d(self.minimum, "minimum", torch.float32, groups)
        for t in (self.scale, self.minimum):
            if t is not None and t.device != self.packed.device:
                raise ValueError("scale and minimum must be on packed's device")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], 2 * self.packed.shape[1])

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        extra = 0 if self.minimum is None else self.minimum.numel()
        return self.packed.numel() + 4 * (self.scale.numel() + extra)

    def to(self, device: torch.device | str) -> Int4Weight:
        minimum = None if self.minimum is None else self.minimum.to(device)
        return Int4Weight(self.packed.to(device), self.scale.to(device), minimum, self.group_size)


INTERLEAVED_KINDS = (GgufKind.Q8_0, GgufKind.Q4_0, GgufKind.Q4_1)
INTERLEAVE = 16  # output features a group


@dataclass(frozen=True)
class InterleavedWeight(_Blocks):
    """A GgufWeight of ``shape`` ``(n, k)`` in groups of 16 output features (the last one
    padded with zero features): ``uint8 [ceil(n / 16), k / 32 * 16 * block_bytes]``. Group
    ``g``'s 32-column block ``b`` holds the 16 features' fp16 scales ``d`` (then Q4_1's
    ``m``), then their integers by column pair ``p``: Q4_* one byte a feature (column
    ``2 p`` low nibble, ``2 p + 1`` high), Q8_0 two (``2 p``, ``2 p + 1``)."""

    def __post_init__(self) -> None:
        if self.kind not in INTERLEAVED_KINDS:
            kinds = [k.name for k in INTERLEAVED_KINDS]
            raise ValueError(f"only {kinds} interleave, got {self.kind!r}")
        n, k = self.shape
        self._check(32, (-(-n // INTERLEAVE), INTERLEAVE * self.kind.row_bytes(k)))


QuantizedWeight = Int8Weight | GgufWeight | InterleavedWeight | Int4Weight


def _float_weight(w: torch.Tensor) -> torch.Tensor:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D floating-point [n, k] tensor, got {w.dtype} {w.shape}")
    return w.float()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: symmetric int8 per output feature, ``scale = absmax / 127`` (1 for a
    row of zeros, which stays zeros), ``q = round(w / scale)`` to nearest (ties to even)."""
    w = _float_weight(w)
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def quantize_int4(w: torch.Tensor, group_size: int = 32, symmetric: bool = True) -> Int4Weight:
    """Group-wise int4: symmetric ``scale = absmax / 7``, ``q = round(w / scale) + 8`` in
    [1, 15]; else ``scale = (max - min) / 15``, ``minimum = min``, ``q = round((w - min) /
    scale)`` in [0, 15]. Constant groups get scale 1 (and dequantize exactly)."""
    w = _float_weight(w)
    n, k = w.shape
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    _check_k(k, group_size, "int4")
    g = w.reshape(n, k // group_size, group_size)
    if symmetric:
        absmax = g.abs().amax(dim=2)
        scale = torch.where(absmax > 0, absmax / 7.0, torch.ones_like(absmax))
        q = torch.round(g / scale[..., None]).clamp_(-8, 7) + 8
        minimum = None
    else:
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi))
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15)
        minimum = lo.contiguous()
    return Int4Weight(pack_nibbles(q.reshape(n, k).to(torch.uint8)), scale, minimum, group_size)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values in [0, 16) ``[n, k]`` -> ``[n, k / 2]``, column 2 i low, 2 i + 1 high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def from_gguf_bytes(
    kind: GgufKind | int | str, raw: bytes | np.ndarray | torch.Tensor, shape: tuple[int, int]
) -> GgufWeight:
    """A GGUF tensor's bytes (as ``gguf.GGUFReader`` maps them, or any buffer) as a weight
    of ``shape`` ``(n, k)`` = (out_features, in_features): GGUF lists dimensions the other
    way round (``ne[0]`` is k). The bytes are copied only where ``raw`` is read-only."""
    if isinstance(kind, str):
        if kind.upper() not in GgufKind.__members__:
            raise ValueError(f"unsupported GGUF type {kind!r}; one of {list(GgufKind.__members__)}")
        kind = GgufKind[kind.upper()]
    elif not isinstance(kind, GgufKind):
        try:
            kind = GgufKind(int(kind))
        except ValueError:
            raise ValueError(f"unsupported GGUF type {kind!r}") from None
    if len(shape) != 2:
        raise ValueError(f"shape must be (n, k), got {shape}")
    n, k = int(shape[0]), int(shape[1])
    _check_k(k, kind.block_size, kind.name)
    if isinstance(raw, torch.Tensor):
        data = raw.contiguous().view(torch.uint8)
    else:
        array = np.ascontiguousarray(
            np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, bytes) else raw
        ).view(np.uint8)
        if not array.flags.writeable:  # bytes, a read-only memory map: torch wants its own
            array = array.copy()
        data = torch.from_numpy(array)
    expected = n * kind.row_bytes(k)
    if data.numel() != expected:
        raise ValueError(
            f"a {kind.name} weight of shape ({n}, {k}) has {expected} bytes, got {data.numel()}"
        )
    return GgufWeight(kind, data.reshape(n, kind.row_bytes(k)), (n, k))
