"""Weight-only quantization of a loaded model: its linear layers and LM head become
:class:`~hotpool.kernels.quant_linear.QuantizedLinear` modules, which read int8 or GGUF blocks
and never hold a dequantized copy of the matrix.

- ``int8``: symmetric int8 made here from the checkpoint's weights, one scale per 32 weights
  of each output feature: GGUF's Q8_0 layout, served by its kernel (1.06 bytes a weight).
  One scale per whole output feature (1.0 byte) was measured too coarse for SmolLM2: its
  perplexity on tests/data/public_domain_prose.txt rose 1.3% over the dense weights (its
  down projections' rows carry outliers), where 32-weight groups stay within 0.5%. A layer
  whose input width is not a multiple of 32 gets the per-feature form.
- ``gguf``: the blocks the snapshot keeps from its GGUF (``worker/snapshot/gguf_blocks``), as
  the file stores them. A fused projection (q/k/v, gate/up) is quantized when all its parts
  share one block type (their rows are then one matrix of blocks); one whose parts differ, or
  a layer of a type the kernels do not serve, stays in the activation dtype.

Embeddings, norms, the MoE experts and the KV cache stay in the activation dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hotpool.kernels.quant_linear import QuantizedLinear, for_device
from hotpool.kernels.quant_weight import GgufKind, GgufWeight, Int8Weight, quantize_int8
from hotpool.worker.models.config import ModelConfig
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.models.weights import LayerParts
from hotpool.worker.snapshot.gguf_blocks import load_blocks

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8", "gguf")
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class QuantizationReport:
    """What :func:`quantize_model` did: the modules it replaced and those it left dense."""

    method: str
    quantized: tuple[str, ...]
    dense: tuple[str, ...]
    weight_bytes: int  # of the quantized modules' weights, as held


def check_quantization(quantization: str, dtype: torch.dtype) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization != "none" and dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"quantization {quantization} computes in float32 or bfloat16, not {dtype}"
        )


def quantize_model(
    model: LlamaModel,
    quantization: str,
    folder: Path,
    layer_parts: LayerParts,
    device: torch.device,
) -> QuantizationReport:
    """Replace ``model``'s linears in place as ``quantization`` says (see the module doc)."""
    cfg = model.config
    targets = _linear_targets(model, cfg, layer_parts)
    if quantization == "int8":
        weights = {path: _int8(linear) for path, (_, linear, _) in targets.items()}
    elif quantization == "gguf":
        blocks = load_blocks(folder)
        if not blocks:
            raise ValueError(
                "the snapshot keeps no GGUF blocks (convert it from a GGUF with them: "
                "`hotpool models pull MODEL --gguf-blocks`), so it cannot serve "
                "quantization: gguf; use int8 or none"
            )
        weights = {
            path: _gguf(sources, linear, blocks) for path, (sources, linear, _) in targets.items()
        }
    else:
        raise ValueError(f"quantize_model takes int8 or gguf, not {quantization!r}")
    quantized, dense, nbytes = [], [], 0
    for path, weight in weights.items():
        _, linear, parent_and_name = targets[path]
        if weight is None:
            dense.append(path)
            continue
        parent, name = parent_and_name
        qw = for_device(weight, device)
        setattr(parent, name, QuantizedLinear(qw, linear.bias))
        quantized.append(path)
        nbytes += qw.nbytes
    if dense:
        log.info("%s: %d linear layers stay dense: %s", quantization, len(dense), dense[:4])
    return QuantizationReport(quantization, tuple(quantized), tuple(dense), nbytes)


_Target = tuple[tuple[str, ...], nn.Linear, tuple[nn.Module, str]]


def _linear_targets(
    model: LlamaModel, cfg: ModelConfig, layer_parts: LayerParts
) -> dict[str, _Target]:
    """Each dense linear of the model: its HF source weights (concatenated in this order),
    the module, and where it hangs."""
    out: dict[str, _Target] = {}
    for i, layer in enumerate(model.layers):
        for ours, part in layer_parts(cfg, i).items():
            if part.experts:
                continue
            owner_name, _, attr = ours.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            module = getattr(owner, attr, None)
            if isinstance(module, nn.Linear):
                sources = tuple(f"model.layers.{i}.{s}.weight" for s in part.sources)
                out[f"layers.{i}.{ours}"] = (sources, module, (owner, attr))
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    out["lm_head"] = ((head,), model.lm_head, (model, "lm_head"))
    return out


def _int8(linear: nn.Linear) -> Int8Weight | GgufWeight:
    w = linear.weight.detach().float()
    n, k = w.shape
    if k % Q8_BLOCK:
        q, scale = quantize_int8(w)
        return Int8Weight(q.contiguous(), scale)
    return GgufWeight(GgufKind.Q8_0, q8_0_blocks(w), (n, k))


Q8_BLOCK = 32


def q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """``w [n, k]`` (k in 32s) as GGUF Q8_0 bytes ``uint8 [n, k / 32 * 34]``: per block of 32,
    the fp16 scale ``d = absmax / 127`` then ``round(w / d)`` as int8 (a block of zeros:
    d = 0, all zeros), as llama.cpp's quantize writes them."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // Q8_BLOCK, Q8_BLOCK)
    d = (blocks.abs().amax(dim=-1, keepdim=True) / 127).half()
    step = torch.where(d == 0, torch.ones_like(d), d).float()
    q = torch.round(blocks / step).clamp_(-127, 127).to(torch.int8)
    packed = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return packed.reshape(n, k // Q8_BLOCK * (2 + Q8_BLOCK)).contiguous()


def _gguf(
    sources: tuple[str, ...],
    linear: nn.Linear,
    blocks: dict[str, tuple[str, torch.Tensor]],
) -> GgufWeight | None:
    parts = [blocks.get(s) for s in sources]
    if any(p is None for p in parts) or len({p[0] for p in parts if p}) != 1:
        return None
    kind = GgufKind[parts[0][0]]  # type: ignore[index]
    data = torch.cat([p[1] for p in parts if p]) if len(parts) > 1 else parts[0][1]  # type: ignore[index]
    shape = (linear.out_features, linear.in_features)
    if data.shape[0] != shape[0] or data.shape[1] != kind.row_bytes(shape[1]):
        raise ValueError(
            f"GGUF blocks of {sources[0]} are {list(data.shape)}, the layer is {list(shape)}"
        )
    return GgufWeight(kind, data.contiguous(), shape)
