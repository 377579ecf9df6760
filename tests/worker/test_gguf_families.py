"""Each architecture the converter knows (Llama, Qwen2, Qwen3, Gemma 3), on tiny random GGUFs
whose matrices cycle through every supported block type: the snapshot is the model HF
transformers builds from the same file (config, weights, logits, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file
from tiny_gguf import HIDDEN, write_tiny_gguf
from tokenizers import Tokenizer

from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.gguf import convert_gguf, read_metadata
from hotpool.worker.snapshot.gguf_arch import hf_config
from hotpool.worker.snapshot.gguf_tensors import unpermute_rotary

# (architecture, tokenizer model, pre-tokenizer, head_dim). HF's loader assumes Qwen3's head_dim
# is 128 and scales Gemma 3's queries by 1/sqrt(256), so the tiny files keep to those.
CASES = [
    ("llama", "llama", "default", 64),
    ("qwen2", "gpt2", "qwen2", 64),
    ("qwen3", "gpt2", "qwen2", 128),
    ("gemma3", "llama", "default", 256),
]
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


@pytest.fixture(scope="module", params=CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with ``m.gguf`` and, under ``snap/``, its conversion to fp32."""
    arch, tokenizer, pre, head_dim = request.param
    folder = tmp_path_factory.mktemp(f"{arch}-{tokenizer}")
    gguf = write_tiny_gguf(
        folder / "m.gguf", arch, tokenizer, pre, quantized=True, head_dim=head_dim
    )
    convert_gguf(gguf, folder / "snap", "fp32")
    return folder


def hf_from_gguf(folder: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="m.gguf", dtype=torch.float32
    ).eval()


@pytest.mark.slow
def test_config_weights_and_logits_match_hf(case: Path) -> None:
    import transformers

    reference = hf_from_gguf(case)
    ours = transformers.AutoModelForCausalLM.from_pretrained(case / "snap", dtype=torch.float32)
    assert type(ours) is type(reference)
    theirs, mine = reference.config.to_dict(), ours.config.to_dict()
    # The file holds rms_norm_eps as float32; HF keeps 9.99999997e-07, we write 1e-06.
    assert np.float32(mine.pop("rms_norm_eps")) == np.float32(theirs.pop("rms_norm_eps"))
    theirs.pop("unk_token_id", None)  # a tokenizer setting HF copies into the config
    differ = {k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)}
    assert differ <= PROVENANCE, {k: (mine.get(k), theirs.get(k)) for k in differ - PROVENANCE}

    expected = reference.state_dict()
    converted = load_file(case / "snap" / "model.safetensors")
    assert set(expected) - set(converted) == {"lm_head.weight"}  # tied
    for name, tensor in converted.items():
        assert torch.equal(tensor, expected[name]), name
    ids = torch.tensor([[1, 5, 7, 9, 30, 40, 2, 8, 260, 265]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)


@pytest.mark.slow
def test_tokenizer_matches_hf(case: Path) -> None:
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(case, gguf_file="m.gguf")
    ours = Tokenizer.from_file(str(case / "snap" / "tokenizer.json"))
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


@pytest.mark.parametrize(
    ("arch", "tokenizer", "pre", "message"),
    [
        ("phi3", "llama", "default", "architecture 'phi3' is not supported (llama, qwen2"),
        ("qwen2", "gpt2", "falcon", "pre-tokenizer 'falcon' unsupported (known: smollm, qwen2"),
    ],
)
def test_what_cannot_be_converted_faithfully_is_refused(
    tmp_path: Path, arch: str, tokenizer: str, pre: str, message: str
) -> None:
    gguf = write_tiny_gguf(tmp_path / "x.gguf", arch, tokenizer, pre)
    with pytest.raises(SnapshotError, match=message.replace("(", r"\(")):
        convert_gguf(gguf, tmp_path / "out", "fp32")
