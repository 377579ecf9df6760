"""Qwen3: the Llama block with an RMSNorm over each query and key head (QK-norm) before
RoPE, and no q/k/v biases."""

from __future__ import annotations

import dataclasses
from typing import Any

from hotpool.worker.models.config import ModelConfig
from hotpool.worker.models.families import llama
from hotpool.worker.models.weights import Part, llama_parts

QK_NORMS = {
    "attention.q_norm": Part(("self_attn.q_norm",)),
    "attention.k_norm": Part(("self_attn.k_norm",)),
}


def parse(data: dict[str, Any]) -> ModelConfig:
    cfg = llama.parse({**data, "model_type": "qwen3", "architectures": None})
    return dataclasses.replace(cfg, family="qwen3", qk_norm=True)


def layer_parts(cfg: ModelConfig, layer: int) -> dict[str, Part]:
    return {**llama_parts(cfg, layer), **QK_NORMS}
