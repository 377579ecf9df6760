"""Each architecture the converter knows (Llama, Qwen2, Qwen3, Qwen3-MoE, Phi-3, Gemma 3), on
tiny random GGUFs whose matrices cycle through every supported block type: the snapshot is the
model HF transformers builds from the same file (config, weights, logits, tokenizer), and
hotpool's engine serving it predicts what HF does. Where HF's GGUF loader loses part of the
model (Phi-3's LongRoPE factors), the reference is HF loading the converted folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file
from tiny_gguf import EXPERTS, HIDDEN, LONGROPE_ORIGINAL, write_tiny_gguf
from tokenizers import Tokenizer

from hotpool.worker.engine.base import EngineRequest
from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine
from hotpool.worker.models.loader import load_model
from hotpool.worker.protocol import SamplingParams
from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.gguf import convert_gguf, read_metadata
from hotpool.worker.snapshot.gguf_arch import hf_config
from hotpool.worker.snapshot.gguf_tensors import unpermute_rotary

# (architecture, tokenizer model, pre-tokenizer, head_dim, LongRoPE). HF's loader assumes
# Qwen3's head_dim is 128 and scales Gemma 3's queries by 1/sqrt(256), so the tiny files keep
# to those; Qwen3-MoE's it reads from the file.
CASES = [
    ("llama", "llama", "default", 64, False),
    ("qwen2", "gpt2", "qwen2", 64, False),
    ("qwen3", "gpt2", "qwen2", 128, False),
    ("qwen3moe", "gpt2", "qwen2", 64, False),
    ("phi3", "llama", "default", 64, False),
    ("phi3", "llama", "default", 64, True),
    ("gemma3", "llama", "default", 256, False),
]
IDS = [f"{c[0]}-{c[1]}" + ("-longrope" if c[4] else "") for c in CASES]
# What HF's GGUF loader drops: Phi-3's LongRoPE factors (rope_factors_long/short tensors) and
# its original context (rope.scaling.original_context_length); it builds plain RoPE.
HF_DROPS = {"phi3-llama-longrope": {"rope_parameters", "original_max_position_embeddings"}}
TEXTS = [
    "hello world and the world",
    "  leading, trailing and  double  spaces  ",
    "naïve café, 日本語, emoji 🚀👍🏽, digits 1234567",
    "def f(x):\n\treturn x ** 2\n\n",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<think>I'm sure they'll say it's fine.</think><|im_end|>",
]
# Names HF fills in that say where a config came from, not what the model is.
PROVENANCE = {"_name_or_path", "_model_name_or_path", "quantization_config", "architectures"}


class Case(NamedTuple):
    folder: Path  # m.gguf and, under snap/, its conversion to fp32
    name: str


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    arch, tokenizer, pre, head_dim, longrope = request.param
    name = IDS[CASES.index(request.param)]
    folder = tmp_path_factory.mktemp(name)
    gguf = write_tiny_gguf(folder / "m.gguf", arch, tokenizer, pre, quantized=True,
                           head_dim=head_dim, longrope=longrope)  # fmt: skip
    convert_gguf(gguf, folder / "snap", "fp32")
    return Case(folder, name)


def hf_from_gguf(folder: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="m.gguf", dtype=torch.float32
    ).eval()


def as_hf_keeps_them(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Experts as transformers v5 holds them once loaded: per layer one ``gate_up_proj``
    ``[experts, 2 * ffn, hidden]`` (gate first) and one ``down_proj``; the snapshot stores
    them per expert, as Qwen3-MoE's own checkpoints (and hotpool's loader) do."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    layers = {k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}
    for layer in layers:
        expert = f"{layer}.mlp.experts.{{}}.{{}}_proj.weight"
        n = sum(1 for k in tensors if k.startswith(f"{layer}.mlp.experts.") and "down" in k)
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[expert.format(e, "gate")], tensors[expert.format(e, "up")]])
             for e in range(n)]
        )  # fmt: skip
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack(
            [tensors[expert.format(e, "down")] for e in range(n)]
        )
    return out


@pytest.mark.slow
def test_config_weights_and_logits_match_hf(case: Case) -> None:
    import transformers

    reference = hf_from_gguf(case.folder)
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        case.folder / "snap", dtype=torch.float32
    )
    assert type(ours) is type(reference)
    theirs, mine = reference.config.to_dict(), ours.config.to_dict()
    # The file holds rms_norm_eps as float32; HF keeps 9.99999997e-07, we write 1e-06.
    assert np.float32(mine.pop("rms_norm_eps")) == np.float32(theirs.pop("rms_norm_eps"))
    theirs.pop("unk_token_id", None)  # a tokenizer setting HF copies into the config
    differ = {k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)}
    allowed = PROVENANCE | HF_DROPS.get(case.name, set())
    assert differ <= allowed, {k: (mine.get(k), theirs.get(k)) for k in differ - allowed}

    expected = reference.state_dict()
    converted = as_hf_keeps_them(load_file(case.folder / "snap" / "model.safetensors"))
    assert set(expected) - set(converted) == {"lm_head.weight"}  # tied
    for name, tensor in converted.items():
        assert torch.equal(tensor, expected[name]), name
    assert ours.state_dict().keys() == expected.keys()  # HF reads every converted tensor
    ids = torch.tensor([[1, 5, 7, 9, 30, 40, 2, 8, 260, 265]])
    with torch.no_grad():
        logits, hf_logits = ours(ids).logits, reference(ids).logits
    if case.name in HF_DROPS:  # our folder keeps what HF's loader dropped, and it matters
        assert (logits - hf_logits).abs().max() > 1e-3
    else:
        assert torch.equal(logits, hf_logits)


@pytest.mark.slow
def test_the_engine_serving_the_snapshot_predicts_what_hf_does(case: Case) -> None:
    """hotpool's engine on the converted folder (paged cache, chunked prefill, decode)
    against HF transformers on the same folder: the same greedy tokens and logprobs."""
    import transformers

    snap = case.folder / "snap"
    hf = transformers.AutoModelForCausalLM.from_pretrained(snap, dtype=torch.float32).eval()
    cpu = torch.device("cpu")
    config = EngineConfig(block_size=4, kv_cache_bytes=1 << 24, max_num_batched_tokens=8,
                          attention_backend="torch")  # fmt: skip
    engine = LLMEngine(load_model(snap, cpu, torch.float32), cpu, config)
    # 19 tokens, under LongRoPE's original 64 (HF switches factors past it, per sequence).
    prompt = [(5 * i * i + 7 * i + 3) % 250 + 3 for i in range(19)]
    assert len(prompt) + 6 < LONGROPE_ORIGINAL
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    engine.add_request(EngineRequest("r", tuple(prompt), params, frozenset()))
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            logprobs.extend(lp.logprob for lp in out.logprobs)
    with torch.inference_mode():
        logits = hf(torch.tensor([[*prompt, *tokens]])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    assert tokens == expected.argmax(dim=-1).tolist()
    chosen = expected[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(logprobs), chosen, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_tokenizer_matches_hf(case: Case) -> None:
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(case.folder, gguf_file="m.gguf")
    ours = Tokenizer.from_file(str(case.folder / "snap" / "tokenizer.json"))
    assert json.loads(ours.to_str()) == json.loads(reference.backend_tokenizer.to_str())
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def test_llama_qk_rows_are_unpermuted_and_gemma_norms_lose_their_one(tmp_path: Path) -> None:
    llama = write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    gemma = write_tiny_gguf(tmp_path / "gemma.gguf", "gemma3", head_dim=256)
    convert_gguf(llama, tmp_path / "llama", "fp32")
    convert_gguf(gemma, tmp_path / "gemma", "fp32")

    raw = {t.name: t for t in GGUFReader(llama).tensors}
    ours = load_file(tmp_path / "llama" / "model.safetensors")
    q = dequantize(raw["blk.1.attn_q.weight"].data, raw["blk.1.attn_q.weight"].tensor_type)
    assert torch.equal(ours["model.layers.1.self_attn.q_proj.weight"], torch.from_numpy(
        unpermute_rotary(q, 4)))  # fmt: skip
    assert torch.equal(ours["model.layers.1.post_attention_layernorm.weight"], torch.from_numpy(
        np.array(raw["blk.1.ffn_norm.weight"].data)))  # fmt: skip

    raw = {t.name: t for t in GGUFReader(gemma).tensors}
    ours = load_file(tmp_path / "gemma" / "model.safetensors")
    pairs = {
        "blk.2.ffn_norm.weight": "model.layers.2.pre_feedforward_layernorm.weight",
        "blk.2.post_ffw_norm.weight": "model.layers.2.post_feedforward_layernorm.weight",
        "blk.2.attn_q_norm.weight": "model.layers.2.self_attn.q_norm.weight",
        "output_norm.weight": "model.norm.weight",
    }
    for gguf_name, hf_name in pairs.items():
        stored = torch.from_numpy(np.array(raw[gguf_name].data))
        assert torch.equal(ours[hf_name], stored - 1), hf_name
    q = np.array(raw["blk.2.attn_q.weight"].data)  # Gemma's q/k rows were never permuted
    assert torch.equal(ours["model.layers.2.self_attn.q_proj.weight"], torch.from_numpy(q))


def test_an_untied_output_is_kept_and_qwen2_keeps_its_biases(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "q.gguf", "qwen2", "gpt2", "qwen2", tied=False)
    convert_gguf(gguf, tmp_path / "snap", "bf16")
    tensors = load_file(tmp_path / "snap" / "model.safetensors")
    config = json.loads((tmp_path / "snap" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "lm_head.weight" in tensors
    assert tensors["model.layers.0.self_attn.k_proj.bias"].dtype == torch.bfloat16


def test_gemma3_config_follows_llama_cpp(tmp_path: Path) -> None:
    """Layer pattern, rope bases and query scale are hard-coded in llama.cpp, not stored."""
    gguf = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", head_dim=256)
    meta = read_metadata(GGUFReader(gguf))
    config = hf_config(meta, {"token_embd.weight"}, "bf16")
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1000000.0, 10000.0)
    assert (config["head_dim"], config["query_pre_attn_scalar"]) == (256, 256)
    assert config["sliding_window"] == 4 and config["torch_dtype"] == "bfloat16"
    # Gemma 3 27B (62 layers) scales queries by 1/sqrt(hidden / heads), not 1/sqrt(head_dim).
    big = {**meta, "gemma3.block_count": 62, "gemma3.attention.key_length": 128}
    assert hf_config(big, set(), "bf16")["query_pre_attn_scalar"] == HIDDEN // 4


def test_phi3_and_qwen3moe_weights_are_the_dequantized_tensors(tmp_path: Path) -> None:
    """Neither is permuted (NeoX rotary): Phi-3's fused q/k/v and gate/up (gate rows first)
    are kept as they are, each Qwen3-MoE expert is its slice of the stacked tensors, and the
    LongRoPE factors are config, not weights."""
    phi3 = write_tiny_gguf(tmp_path / "phi3.gguf", "phi3", quantized=True, longrope=True)
    moe = write_tiny_gguf(tmp_path / "moe.gguf", "qwen3moe", "gpt2", "qwen2", quantized=True)
    convert_gguf(phi3, tmp_path / "phi3", "fp32")
    convert_gguf(moe, tmp_path / "moe", "fp32")

    def source(raw: dict[str, Any], name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(dequantize(raw[name].data, raw[name].tensor_type)))

    raw = {t.name: t for t in GGUFReader(phi3).tensors}
    ours = load_file(tmp_path / "phi3" / "model.safetensors")
    pairs = {
        "blk.3.attn_qkv.weight": "model.layers.3.self_attn.qkv_proj.weight",
        "blk.3.ffn_up.weight": "model.layers.3.mlp.gate_up_proj.weight",
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
        "blk.3.attn_output.weight": "model.layers.3.self_attn.o_proj.weight",
    }
    for gguf_name, hf_name in pairs.items():
        assert torch.equal(ours[hf_name], source(raw, gguf_name)), hf_name
    assert not any("rope" in name for name in ours)
    config = json.loads((tmp_path / "phi3" / "config.json").read_text())
    rope = config["rope_scaling"]
    assert rope["long_factor"] == source(raw, "rope_factors_long.weight").tolist()
    assert rope["short_factor"] == source(raw, "rope_factors_short.weight").tolist()
    assert (rope["rope_type"], config["original_max_position_embeddings"]) == ("longrope", 64)
    assert "attention_factor" not in rope  # the file's is the one HF derives
    assert config["sliding_window"] is None  # written by the converter, ignored by llama.cpp

    raw = {t.name: t for t in GGUFReader(moe).tensors}
    ours = load_file(tmp_path / "moe" / "model.safetensors")
    gate, up = source(raw, "blk.2.ffn_gate_exps.weight"), source(raw, "blk.2.ffn_up_exps.weight")
    down = source(raw, "blk.2.ffn_down_exps.weight")
    assert gate.shape[0] == EXPERTS
    for e in range(EXPERTS):
        expert = f"model.layers.2.mlp.experts.{e}"
        assert torch.equal(ours[f"{expert}.gate_proj.weight"], gate[e])
        assert torch.equal(ours[f"{expert}.up_proj.weight"], up[e])
        assert torch.equal(ours[f"{expert}.down_proj.weight"], down[e])
    router = source(raw, "blk.2.ffn_gate_inp.weight")
    assert torch.equal(ours["model.layers.2.mlp.gate.weight"], router)
    q = source(raw, "blk.2.attn_q.weight")
    assert torch.equal(ours["model.layers.2.self_attn.q_proj.weight"], q)
    assert not any("ffn" in name or ".mlp.gate_proj" in name for name in ours)


def test_qwen3moe_and_phi3_configs_follow_the_file(tmp_path: Path) -> None:
    """What HF's GGUF loader leaves at its defaults comes from the file here."""
    moe = read_metadata(GGUFReader(write_tiny_gguf(tmp_path / "m.gguf", "qwen3moe", "gpt2",
                                                   "qwen2")))  # fmt: skip
    config = hf_config({**moe, "qwen3moe.expert_feed_forward_length": 512}, set(), "bf16")
    assert (config["num_experts"], config["num_experts_per_tok"]) == (EXPERTS, 2)
    assert (config["moe_intermediate_size"], config["head_dim"]) == (512, 64)
    assert config["norm_topk_prob"] is True and config["mlp_only_layers"] == []
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]

    phi3 = read_metadata(GGUFReader(write_tiny_gguf(tmp_path / "p.gguf", "phi3")))
    config = hf_config(phi3, set(), "bf16")
    assert config["rope_scaling"] is None and config["original_max_position_embeddings"] == 4096
    assert "partial_rotary_factor" not in config and config["sliding_window"] is None
    # Phi-4-mini rotates 3/4 of each head: said so, and hotpool then refuses it at load.
    partial = hf_config({**phi3, "phi3.rope.dimension_count": 48}, set(), "bf16")
    assert partial["partial_rotary_factor"] == 0.75
    factors = {n: np.ones(24, np.float32) for n in ("rope_factors_long.weight",
                                                    "rope_factors_short.weight")}  # fmt: skip
    stated = {**phi3, "phi3.rope.dimension_count": 48, "phi3.rope.scaling.attn_factor": 1.5}
    rope = hf_config({**stated, "phi3.context_length": 8192}, set(), "bf16", factors)
    assert rope["rope_scaling"]["attention_factor"] == 1.5  # not the 1.04 HF derives
    with pytest.raises(SnapshotError, match="rope_factors_long and _short"):
        hf_config(phi3, set(), "bf16", {"rope_factors_long.weight": np.ones(32, np.float32)})


@pytest.mark.parametrize(
    ("arch", "tokenizer", "pre", "message"),
    [
        ("qwen2moe", "llama", "default", "architecture 'qwen2moe' is not supported (llama, qwen2"),
        ("qwen2", "gpt2", "falcon", "pre-tokenizer 'falcon' unsupported (known: smollm, qwen2"),
    ],
)
def test_what_cannot_be_converted_faithfully_is_refused(
    tmp_path: Path, arch: str, tokenizer: str, pre: str, message: str
) -> None:
    gguf = write_tiny_gguf(tmp_path / "x.gguf", arch, tokenizer, pre)
    with pytest.raises(SnapshotError, match=message.replace("(", r"\(")):
        convert_gguf(gguf, tmp_path / "out", "fp32")
