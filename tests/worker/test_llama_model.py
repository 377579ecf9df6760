"""The model's math: against HF transformers' Llama, and cached vs uncached attention."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import TINY, tiny_model

from hotpool.kernels import cpu_ops
from hotpool.worker.models.attention import ContiguousAttention, SequenceKVCache
from hotpool.worker.models.llama import LlamaModel, convert_hf_state_dict


def _logits(
    model: LlamaModel, ids: list[int], chunks: list[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Logits for every position, computing the sequence in the given chunk sizes."""
    cfg = model.config
    cache = SequenceKVCache(cfg.num_hidden_layers, len(ids), cfg.num_key_value_heads, cfg.head_dim,
                            dtype, torch.device("cpu"))  # fmt: skip
    out, start = [], 0
    with torch.inference_mode():
        for n in chunks:
            t = torch.tensor(ids[start : start + n])
            hidden = model(t, torch.arange(start, start + n), ContiguousAttention(cache, start, n))
            out.append(model.logits(hidden))
            start += n
    return torch.cat(out)


def test_matches_hf_transformers_llama_with_the_same_weights() -> None:
    import transformers

    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "rope_theta", "max_position_embeddings", "tie_word_embeddings")  # fmt: skip
    hf_cfg = transformers.LlamaConfig(
        **{f: getattr(TINY, f) for f in fields}, attn_implementation="eager"
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    ours = tiny_model()
    ours.load_state_dict(convert_hf_state_dict(hf.state_dict(), TINY), strict=False)
    ids = [5, 17, 3, 88, 42, 42, 7, 1, 60, 33, 12]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(ours, ids, [len(ids)]), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunks", [[1] * 12, [5, 1, 1, 5], [3, 4, 5], [11, 1]])
def test_cached_decode_and_chunked_prefill_equal_one_full_pass(chunks: list[int]) -> None:
    model = tiny_model(seed=1)
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
    full = _logits(model, ids, [len(ids)])
    torch.testing.assert_close(_logits(model, ids, chunks), full, atol=1e-5, rtol=1e-5)


def test_attention_rejects_a_step_past_the_cache() -> None:
    cache = SequenceKVCache(1, 4, 1, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="holds 4 tokens"):
        ContiguousAttention(cache, 3, 2)


def test_prepacked_bf16_linears_compute_what_plain_ones_do() -> None:
    import copy

    from hotpool.worker.models.packed_linear import pack_linears, packing_available

    if not packing_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no native bf16 here (AVX2 only): load_model does not prepack")
    plain = tiny_model(seed=2).to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert pack_linears(packed) == 2 * 4 + 1  # four linears per layer, and the lm_head
    # hotpool's kernel where the CPU has AVX-512 and the shape fits (features in 16s),
    # oneDNN for the rest: the lm_head's 97 features.
    backends = {name: m.backend for name, m in packed.named_modules() if hasattr(m, "backend")}
    assert backends.pop("lm_head") == "onednn"
    ops = cpu_ops.load()
    fast = ops is not None and ops.avx512
    assert set(backends.values()) == {"native" if fast else "onednn"}
    gate_up = [type(layer.feed_forward.w13).__name__ for layer in packed.layers]
    assert gate_up == ["PackedGateUp" if fast else "PackedLinear"] * len(packed.layers)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    c = plain.config
    outs = []
    for model in (plain, packed):
        cache = SequenceKVCache(c.num_hidden_layers, len(ids), c.num_key_value_heads, c.head_dim,
                                torch.bfloat16, torch.device("cpu"))  # fmt: skip
        with torch.inference_mode():
            hidden = model(
                torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(cache, 0, len(ids))
            )
            outs.append(model.logits(hidden))
    torch.testing.assert_close(outs[1], outs[0], atol=0.05, rtol=0.02)
    assert (outs[1].argmax(-1) == outs[0].argmax(-1)).all()


def test_fused_cpu_kernels_compute_what_torch_ops_do_in_bf16() -> None:
    """bfloat16 on the CPU runs the fused C kernels; both paths stay as close to the float32
    model as bfloat16 allows, and to each other."""
    from hotpool.kernels import cpu_ops

    if cpu_ops.load() is None:
        pytest.fail("the CPU kernels did not build (CI has a C compiler)")
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
    chunks = [7, 1, 1, 3]
    exact = _logits(tiny_model(seed=4), ids, [len(ids)])
    native = tiny_model(seed=4).to(torch.bfloat16)
    plain = tiny_model(seed=4).to(torch.bfloat16)
    plain.native_ops = False
    got = {}
    for name, model in (("native", native), ("torch", plain)):
        got[name] = _logits(model, ids, chunks, torch.bfloat16)
        assert model.ops(torch.zeros(1, dtype=torch.bfloat16)).name == name
        torch.testing.assert_close(got[name], exact, atol=0.15, rtol=0.05)
    torch.testing.assert_close(got["native"], got["torch"], atol=0.1, rtol=0.05)
    assert (got["native"].argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
