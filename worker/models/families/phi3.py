"""Phi-3 (and Phi-4 with full rotary): the Llama block with q/k/v and gate/up stored fused
(``qkv_proj``, ``gate_up_proj``, in the order our fused projections use), LongRoPE scaling
and a sliding window on every layer."""

from __future__ import annotations

import dataclasses
from typing import Any

from hotpool.worker.models.config import ModelConfig
from hotpool.worker.models.families import llama
from hotpool.worker.models.weights import Part, llama_parts


def parse(data: dict[str, Any]) -> ModelConfig:
    cfg = llama.parse({**data, "architectures": None, "model_type": "phi3"})
    return dataclasses.replace(cfg, family="phi3")


def layer_parts(cfg: ModelConfig, layer: int) -> dict[str, Part]:
    return {
        **llama_parts(cfg, layer),
        "attention.wqkv": Part(("self_attn.qkv_proj",), cfg.qkv_bias),
        "feed_forward.w13": Part(("mlp.gate_up_proj",), cfg.mlp_bias),
    }
