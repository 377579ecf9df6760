"""Qwen3-MoE: Qwen3's attention, and on its sparse layers a router that sends each token to
``num_experts_per_tok`` of ``num_experts`` SwiGLU experts (no shared expert)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hotpool.worker.models.config import ModelConfig, MoEConfig
from hotpool.worker.models.families import qwen3
from hotpool.worker.models.weights import Part


def parse(data: dict[str, Any]) -> ModelConfig:
    cfg = qwen3.parse(data)
    experts = int(data.get("num_experts") or data.get("num_local_experts") or 0)
    top_k = int(data.get("num_experts_per_tok", 0))
    if experts < 1 or not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} of num_experts={experts} is not a MoE")
    # HF: layer i is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th.
    step = int(data.get("decoder_sparse_step", 1))
    dense = {int(i) for i in data.get("mlp_only_layers") or ()}
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers))
    moe = MoEConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(data["moe_intermediate_size"]),
        norm_topk_prob=bool(data.get("norm_topk_prob", False)),
        layers=layers,
    )
    return dataclasses.replace(cfg, family="qwen3_moe", moe=moe)


def layer_parts(cfg: ModelConfig, layer: int) -> dict[str, Part]:
    parts = qwen3.layer_parts(cfg, layer)
    if cfg.moe is None or not cfg.moe.layers[layer]:
        return parts
    n = cfg.moe.num_experts
    del parts["feed_forward.w13"], parts["feed_forward.w2"]
    return {
        **parts,
        "feed_forward.gate": Part(("mlp.gate",)),
        "feed_forward.w13": Part(
            ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"), experts=n
        ),
        "feed_forward.w2": Part(("mlp.experts.{e}.down_proj",), experts=n),
    }
