"""Build a model from a snapshot folder: config.json plus ``*.safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from hotpool.worker.models.families import SUPPORTED_ARCHITECTURES, family_for
from hotpool.worker.models.few_rows_linear import few_rows_pay, use_few_rows_linears
from hotpool.worker.models.llama import LlamaModel, local_rotary_for, rotary_for
from hotpool.worker.models.packed_linear import pack_linears, packing_available
from hotpool.worker.models.quantize import QUANTIZATIONS, check_quantization, quantize_model
from hotpool.worker.models.weights import convert_hf_state_dict

__all__ = ["DTYPES", "SUPPORTED_ARCHITECTURES", "ModelLoadError", "load_model"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ModelLoadError(Exception):
    """The snapshot holds a model this worker cannot run."""


def load_model(
    path: Path,
    device: torch.device,
    dtype: torch.dtype | None = None,
    pack: bool = True,
    quantization: str = "none",
) -> LlamaModel:
    """Load a HF-format checkpoint of a supported family. ``dtype=None`` keeps the
    checkpoint's dtype; ``pack`` prepacks linear weights where that is faster (bf16 on
    CPU; fp32 on CPU gets :mod:`few_rows_linear` where it measures faster);
    ``quantization`` (none, int8, gguf) serves the linear layers quantized (:mod:`quantize`).
    """
    config = json.loads((path / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    try:
        family = family_for(config)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization {quantization!r}: choose {', '.join(QUANTIZATIONS)}")
    try:
        cfg = family.parse(config)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{arch}: {exc}") from exc
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {path}")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        hf.update(load_file(f, device=str(device)))
    try:
        state = convert_hf_state_dict(hf, cfg, family.layer_parts, family.norm_offset)
    except KeyError as exc:
        raise ModelLoadError(f"checkpoint lacks tensor {exc.args[0]!r}") from None
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    target = dtype or hf["model.embed_tokens.weight"].dtype
    state = {k: v.to(target) for k, v in state.items()}
    # Build on the meta device and adopt the loaded tensors (no random init, no extra copy).
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.load_state_dict(state, strict=False, assign=True)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"checkpoint lacks {missing[:3]}")
    with torch.device(device):
        model.rope = rotary_for(cfg)
        model.local_rope = local_rotary_for(cfg)
    model.eval().requires_grad_(False)
    if quantization != "none":
        try:
            check_quantization(quantization, target)
            model.quantization = quantize_model(
                model, quantization, path, family.layer_parts, device
            )
        except ValueError as exc:
            raise ModelLoadError(f"{arch}: {exc}") from None
    if pack and packing_available(device, target):
        pack_linears(model)  # what stayed dense
    elif pack and device.type == "cpu" and target == torch.float32 and few_rows_pay(model):
        use_few_rows_linears(model)  # what stayed dense: decode rows at the copy bandwidth
    return model
