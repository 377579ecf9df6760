from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.gguf import convert_gguf, unpermute_rotary
from hotpool.worker.snapshot.manifest import read_manifest
from hotpool.worker.snapshot.pull import pull_smollm2

TEXTS = [
    "Hello, world!",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "12345 and 3.14159, dated 2024-11-30",
    "naïve café, 日本語のテキスト, emoji 🚀👍🏽",
    "def square(x):\n    return x ** 2\n\n\nprint(square(12))\n",
    "I'm sure they'll say it's fine.",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nnewlines",
]


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(hf_smollm2_tokenizer: Any) -> Any:
    return hf_smollm2_tokenizer


@pytest.fixture(scope="module")
def ours(smollm2_snapshot_fp32: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_snapshot_fp32 / "tokenizer.json"))


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to HF q/k weights."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_permute() -> None:
    hf = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)  # 3 heads of dim 8
    gguf = llama_cpp_permute(hf, n_head=3)
    # Head 0: rotary pairs (i, i + 4) of HF become adjacent rows in GGUF.
    assert [int(r) for r in gguf[:4, 0]] == [0, 20, 5, 25]
    np.testing.assert_array_equal(unpermute_rotary(gguf, n_head=3), hf)


def test_config_describes_smollm2(smollm2_snapshot_fp32: Path) -> None:
    config = json.loads((smollm2_snapshot_fp32 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((smollm2_snapshot_fp32 / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_manifest_lists_the_converted_files(smollm2_snapshot_bf16: Path) -> None:
    manifest = read_manifest(smollm2_snapshot_bf16)
    assert (manifest.architecture, manifest.dtype) == ("llama", "bf16")
    assert [f.path for f in manifest.files] == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_bf16_weights_are_the_fp32_weights_rounded(
    smollm2_snapshot_fp32: Path, smollm2_snapshot_bf16: Path
) -> None:
    names = ["model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"]
    with (
        safe_open(smollm2_snapshot_fp32 / "model.safetensors", "pt") as f32,
        safe_open(smollm2_snapshot_bf16 / "model.safetensors", "pt") as b16,
    ):
        assert "lm_head.weight" not in set(b16.keys())  # tied to the embeddings
        for name in names:
            half = b16.get_tensor(name)
            assert half.dtype == torch.bfloat16
            assert torch.equal(half, f32.get_tensor(name).to(torch.bfloat16))


def test_tokenizer_matches_hf_gguf_tokenizer(ours: Tokenizer, hf_gguf_tokenizer: Any) -> None:
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == hf_gguf_tokenizer(text)["input_ids"], text
        assert hf_gguf_tokenizer.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_control_tokens_stay_whole(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>assistant\nHi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "assistant\nHi"  # specials skipped by default


def test_digits_split_before_the_byte_level_regex(ours: Tokenizer) -> None:
    """llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) isolates digits
    first, so a run of spaces before a digit stays one piece. HF's GGUF loader (5.24) skips
    that step and splits it as "Ġ" + "Ġ1"; on these inputs we follow the model."""
    vocab = ours.get_vocab()
    assert ours.encode("a  1").ids == [vocab["a"], vocab["ĠĠ"], vocab["1"]]
    assert ours.encode("12345").tokens == ["1", "2", "3", "4", "5"]


def test_chat_template_renders_like_hf(smollm2_snapshot_fp32: Path, hf_gguf_tokenizer: Any) -> None:
    import transformers

    ours_hf = transformers.AutoTokenizer.from_pretrained(smollm2_snapshot_fp32)
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = ours_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert (ours_hf.eos_token, ours_hf.pad_token, ours_hf.bos_token) == (
        "<|im_end|>",
        "<|im_end|>",
        "<|im_start|>",
    )


def test_unsupported_dtype_is_rejected(smollm2_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="unsupported dtype"):
        convert_gguf(smollm2_gguf, tmp_path, dtype="int8")


@pytest.mark.slow
def test_weights_and_logits_match_hf_loading_the_gguf(
    hf_smollm2_model: Any, smollm2_snapshot_fp32: Path
) -> None:
    import transformers

    reference = hf_smollm2_model
    expected = reference.state_dict()
    converted = load_file(smollm2_snapshot_fp32 / "model.safetensors")

    assert set(expected) - set(converted) == {"lm_head.weight"}
    assert set(converted) <= set(expected)
    for name, tensor in converted.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)

    # Our config.json must describe the same network: same logits from our folder.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_snapshot_fp32, dtype=torch.float32
    )
    ids = torch.tensor([[1, 4093, 198, 19556, 28, 905, 17, 2, 198, 1, 520, 9531, 198]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits)


@pytest.mark.slow
def test_pull_then_fetch(test_cache_dir: Path, tmp_path: Path) -> None:
    uri, manifest = pull_smollm2(
        f"file://{tmp_path}/objects",
        name="smol",
        download_dir=test_cache_dir / "smollm2",
        keep_downloads=True,  # the test cache's GGUF, which other tests read
    )

    assert uri == f"file://{tmp_path}/objects/snapshots/smol"
    cached = SnapshotCache(tmp_path / "cache").fetch(uri)
    assert cached.manifest == manifest and not cached.cache_hit
    assert cached.manifest.dtype == "bf16" and cached.manifest.total_bytes > 250_000_000
    # The catalog's word: an instruct model, served from the GGUF's own blocks by default.
    assert manifest.kind == "instruct" and manifest.quantized
    assert manifest.serving_defaults == {"quantization": "gguf", "default_max_tokens": 512}
