"""A Gemma 3 snapshot converted with the catalog's chat settings (its GGUF has no template):
Gemma's own chat format, rendered the same by the worker and by HF, and a reply that ends at
``<end_of_turn>``. A tiny random-weight Gemma 3 GGUF stands in for the real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_gguf

from hotpool.worker.protocol import ChatMessage
from hotpool.worker.snapshot.gguf import convert_gguf
from hotpool.worker.snapshot.model_catalog import catalog_model
from hotpool.worker.tokenizer import TemplateError, TextTokenizer

CHAT = [
    ChatMessage("system", "Be brief."),
    ChatMessage("user", "Hi  "),
    ChatMessage("assistant", " Hello! "),
    ChatMessage("user", "2+2?"),
]
RENDERED = (
    "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
    "<start_of_turn>model\nHello!<end_of_turn>\n"
    "<start_of_turn>user\n2+2?<end_of_turn>\n"
    "<start_of_turn>model\n"
)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3")
    gguf = write_tiny_gguf(folder / "g.gguf", "gemma3", head_dim=256)
    convert_gguf(gguf, folder / "snap", "bf16", catalog_model("gemma3-270m").chat)
    return folder / "snap"


@pytest.fixture(scope="module")
def tok(snapshot: Path) -> TextTokenizer:
    return TextTokenizer(snapshot)


def test_the_catalog_template_renders_gemmas_turns(tok: TextTokenizer) -> None:
    assert tok.apply_chat_template(CHAT) == RENDERED


def test_hf_renders_the_snapshot_template_the_same(snapshot: Path) -> None:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(snapshot)
    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == RENDERED


def test_roles_must_alternate(tok: TextTokenizer) -> None:
    with pytest.raises(TemplateError, match="Conversation roles must alternate user/assistant"):
        tok.apply_chat_template([ChatMessage("user", "a"), ChatMessage("user", "b")])


def test_turn_markers_are_single_tokens_and_bos_comes_once(tok: TextTokenizer) -> None:
    (start,) = tok.encode("<start_of_turn>")[1:]  # after the BOS every encode starts with
    (end,) = tok.encode("<end_of_turn>")[1:]
    ids = tok.encode_chat(CHAT)
    assert ids[0] == 2 and ids.count(2) == 1  # <bos>: the template's, not a second one
    assert (ids.count(start), ids.count(end)) == (4, 3)


def test_a_reply_ends_at_end_of_turn_as_well_as_eos(snapshot: Path, tok: TextTokenizer) -> None:
    (end,) = tok.encode("<end_of_turn>")[1:]
    generation = json.loads((snapshot / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 2, "eos_token_id": [1, end], "pad_token_id": 0}
    assert tok.eos_token_ids == {1, end}
    assert json.loads((snapshot / "config.json").read_text())["eos_token_id"] == 1
