"""A tiny random-weight Llama, built on the fly, for fast engine and model tests."""

from __future__ import annotations

import torch

from hotpool.worker.models.llama import LlamaModel, ModelConfig, RotaryEmbedding

TINY = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_ids=(96,),
)


def tiny_model(seed: int = 0, cfg: ModelConfig = TINY) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # not all-ones: catch a skipped norm
            else:
                p.normal_(0.0, 0.2)
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    return model.eval()
