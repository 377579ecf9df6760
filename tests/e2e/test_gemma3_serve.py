"""Gemma 3 270M (the PyPI GGUF, a second model family) served by a real ``hotpool serve``:
chat completions through the official openai client in Gemma's own chat format, usage in
the ledger, and the template's own error as a 400."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest
from openai import OpenAI
from server_process import Server, running_server

from hotpool.worker.protocol import ChatMessage
from hotpool.worker.snapshot.manifest import (
    MANIFEST_NAME,
    read_manifest,
    write_manifest,
)
from hotpool.worker.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow

MODEL = "gemma3"


@pytest.fixture(scope="module")
def gemma_server(
    tmp_path_factory: pytest.TempPathFactory, gemma3_snapshot_fp32: Path
) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("hotpool-gemma3")
    uri = f"file://{_labelled_instruct(gemma3_snapshot_fp32, home / 'gemma3-chat')}"
    env = {"HOTPOOL_MAX_WORKERS": "1", "HOTPOOL_WARM_WORKERS": "0"}
    with running_server(home, uri, env, f"{MODEL}={uri}") as srv:
        yield srv


def _labelled_instruct(pulled: Path, folder: Path) -> Path:
    """The pulled snapshot, its manifest saying ``instruct`` (as Gemma 3 270M-IT's would,
    with the same template): the pulled one says ``base``, and a base model's chat is a 400
    (tests/worker/test_worker_server.py). Its files are hard links, not copies."""
    shutil.copytree(pulled, folder, copy_function=os.link)
    (folder / MANIFEST_NAME).unlink()
    manifest = read_manifest(pulled / MANIFEST_NAME)
    assert manifest.kind == "base"
    write_manifest(folder, replace(manifest, kind="instruct"))  # the same files
    return folder


@pytest.fixture(scope="module")
def client(gemma_server: Server) -> OpenAI:
    return OpenAI(base_url=f"{gemma_server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def test_gemma3_answers_a_chat_and_its_usage_lands_in_the_ledger(
    gemma_server: Server, client: OpenAI, gemma3_snapshot_fp32: Path
) -> None:
    # Gemma's template has no system role: it folds the system text into the first user turn.
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16
    )
    full = raw.parse()
    text = full.choices[0].message.content
    assert text and text.strip()
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.model == MODEL

    # The prompt was Gemma's chat format, as the snapshot's tokenizer renders it.
    chat = [ChatMessage(m["role"], m["content"]) for m in messages]
    prompt_ids = TextTokenizer(gemma3_snapshot_fp32).encode_chat(chat)
    assert full.usage is not None
    assert full.usage.prompt_tokens == len(prompt_ids)

    row = gemma_server.ledger_row(raw.headers["x-request-id"])
    assert (row.deployment, row.status, row.endpoint) == (MODEL, "completed", "chat.completions")
    assert (row.prompt_tokens, row.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )

    # Greedy: the streamed answer is the same text, Gemma's <end_of_turn> never shown.
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text
    assert "<end_of_turn>" not in streamed


def test_a_conversation_gemmas_template_refuses_is_a_400_naming_the_problem(
    client: OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            max_tokens=4,
        )
    assert "roles must alternate" in str(err.value)
