"""Map a HF checkpoint's tensors onto hotpool's decoder (:class:`~.llama.LlamaModel`).

Each family lists, per layer, which HF modules make each of our parameters
(:class:`Part`): q/k/v and gate/up are concatenated into one fused projection, experts are
stacked into one tensor, and Gemma's norms get the 1 its RMSNorm adds at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hotpool.worker.models.config import ModelConfig


@dataclass(frozen=True)
class Part:
    """One of our per-layer parameters, made of HF modules under ``model.layers.{i}.``."""

    sources: tuple[str, ...]  # concatenated along the output dimension, in this order
    bias: bool = False
    experts: int = 0  # > 0: sources hold "{e}"; each expert's tensor, stacked [E, ...]
    offset: float = 0.0  # added to the weight (Gemma's RMSNorm scales by 1 + w)


LayerParts = Callable[[ModelConfig, int], dict[str, Part]]

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


def llama_parts(cfg: ModelConfig, layer: int) -> dict[str, Part]:
    """Llama's layer (Mistral and Qwen2 too): our module -> the HF modules it is made of."""
    return {
        "attention_norm": Part(("input_layernorm",)),
        "ffn_norm": Part(("post_attention_layernorm",)),
        "attention.wqkv": Part(QKV, cfg.qkv_bias),
        "attention.wo": Part(("self_attn.o_proj",), cfg.o_bias),
        "feed_forward.w13": Part(GATE_UP, cfg.mlp_bias),
        "feed_forward.w2": Part(("mlp.down_proj",), cfg.mlp_bias),
    }


def convert_hf_state_dict(
    hf: dict[str, torch.Tensor],
    cfg: ModelConfig,
    layer_parts: LayerParts = llama_parts,
    norm_offset: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Our state dict from a HF one. KeyError names a tensor the config needs and the
    checkpoint lacks; ValueError lists tensors the config leaves unused (say, biases under
    ``attention_bias: false``), which would otherwise be dropped silently."""
    embed = hf["model.embed_tokens.weight"]
    used = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    # Tied checkpoints usually omit lm_head; when one stores it anyway, tying still wins.
    lm_head = embed if cfg.tie_word_embeddings else hf.get("lm_head.weight", embed)
    norm = _offset(hf["model.norm.weight"], norm_offset)
    out = {"embed.weight": embed, "norm.weight": norm, "lm_head.weight": lm_head}
    for i in range(cfg.num_hidden_layers):
        for ours, part in layer_parts(cfg, i).items():
            for kind in ("weight", "bias") if part.bias else ("weight",):
                if part.experts:
                    stacked = []
                    for e in range(part.experts):
                        names = [f"model.layers.{i}.{s.format(e=e)}.{kind}" for s in part.sources]
                        used.update(names)
                        stacked.append(_cat([hf[n] for n in names]))
                    key = f"layers.{i}.{ours}" + ("" if kind == "weight" else "_bias")
                    out[key] = torch.stack(stacked)
                    continue
                names = [f"model.layers.{i}.{src}.{kind}" for src in part.sources]
                used.update(names)
                tensor = _cat([hf[n] for n in names])
                out[f"layers.{i}.{ours}.{kind}"] = _offset(tensor, part.offset)
    # Old checkpoints saved the rotary tables; they are recomputed from the config.
    unused = sorted(n for n in hf if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"checkpoint has tensors this config does not use: {unused[:4]}")
    return out


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _offset(weight: torch.Tensor, offset: float) -> torch.Tensor:
    # In fp32: (1 + w) rounded once, as HF's Gemma RMSNorm computes it in fp32.
    return weight if not offset else (weight.float() + offset).to(weight.dtype)
