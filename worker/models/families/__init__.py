"""The model families hotpool runs, by the HF ``architectures`` name in ``config.json``.

A family is a config parser and the per-layer map of HF tensors onto the decoder's
parameters; the decoder itself (:mod:`hotpool.worker.models.llama`) is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotpool.worker.models.config import ModelConfig
from hotpool.worker.models.weights import LayerParts, llama_parts


@dataclass(frozen=True)
class Family:
    name: str
    parse: Callable[[dict[str, Any]], ModelConfig]
    layer_parts: LayerParts
    norm_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma: 1)


def _families() -> dict[str, Family]:
    from hotpool.worker.models.families import gemma3, llama, phi3, qwen3, qwen3_moe

    llama_family = Family("llama", llama.parse, llama_parts)
    return {
        "LlamaForCausalLM": llama_family,
        "MistralForCausalLM": llama_family,
        "Qwen2ForCausalLM": llama_family,
        "Qwen3ForCausalLM": Family("qwen3", qwen3.parse, qwen3.layer_parts),
        "Qwen3MoeForCausalLM": Family("qwen3_moe", qwen3_moe.parse, qwen3_moe.layer_parts),
        "Phi3ForCausalLM": Family("phi3", phi3.parse, phi3.layer_parts),
        "Gemma3ForCausalLM": Family("gemma3", gemma3.parse, gemma3.layer_parts, gemma3.NORM_OFFSET),
    }


FAMILIES = _families()
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def family_for(config: dict[str, Any]) -> Family:
    """The family of a HF ``config.json``; ValueError names an architecture we do not run."""
    arch = (config.get("architectures") or ["?"])[0]
    family = FAMILIES.get(arch)
    if family is None:
        raise ValueError(
            f"architecture {arch!r} is not supported (have {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return family
