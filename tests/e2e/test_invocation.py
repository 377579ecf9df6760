"""n choices, logprobs and the native invoke API end to end: the official OpenAI client (sync
and async) and raw HTTP against a real server running SmolLM2; each request is one ledger
row that bills the prompt once and every choice's tokens."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from server_process import Server

pytestmark = pytest.mark.slow

MESSAGES: Any = [{"role": "user", "content": "Name a fruit."}]
PROMPT = "The capital of France is"
EOS = "<|im_end|>"


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _check_ledger(server: Server, request_id: str | None, usage: Any, endpoint: str) -> None:
    assert request_id
    row = server.ledger_row(request_id)
    assert (row.prompt_tokens, row.completion_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert (row.status, row.endpoint) == ("completed", endpoint)


def _check_chat_position(entry: Any, k: int) -> None:
    """One chat logprobs entry: values <= 0, ``k`` alternatives best first, the sampled
    token's logprob equal to its own entry among them, bytes that spell the token."""
    assert entry.logprob <= 0
    tops = entry.top_logprobs
    assert len(tops) == k
    assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
    assert all(t.logprob <= 0 for t in tops)
    same = [t for t in tops if t.bytes == entry.bytes]
    if same:
        assert same[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    if entry.token != EOS:
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def _prompt_tokens(client: OpenAI) -> int:
    one = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1)
    assert one.usage is not None
    return one.usage.prompt_tokens


def test_chat_n_choices_with_logprobs(server: Server) -> None:
    client = _client(server)
    full = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, n=2, max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3, user="alice",
    )  # fmt: skip
    assert [c.index for c in full.choices] == [0, 1]
    assert full.choices[0].message.content == full.choices[1].message.content  # greedy
    assert full.usage is not None
    assert full.usage.prompt_tokens == _prompt_tokens(client)  # the prompt counts once
    counted = 0
    for choice in full.choices:
        assert choice.finish_reason in ("stop", "length") and choice.logprobs is not None
        content = choice.logprobs.content or []
        for entry in content:
            _check_chat_position(entry, 3)
            assert entry.token == entry.top_logprobs[0].token  # greedy takes the best
        spelled = b"".join(bytes(e.bytes) for e in content).decode(errors="replace")
        assert spelled.removesuffix(EOS) == choice.message.content
        counted += len(content)
    assert counted == full.usage.completion_tokens  # one entry per billed token
    _check_ledger(server, full._request_id, full.usage, "chat.completions")


def test_chat_stream_of_n_choices(server: Server) -> None:
    client = _client(server)
    stream = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, n=2, max_tokens=6, temperature=0.8, seed=5,
        logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    request_id = stream.response.headers["x-request-id"]
    chunks = list(stream)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    roles: dict[int, list[str | None]] = {0: [], 1: []}
    counted = 0
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index].append(choice.delta.role)
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
        if choice.logprobs is not None:
            for entry in choice.logprobs.content or []:
                _check_chat_position(entry, 2)
                counted += 1
    assert all(r[0] == "assistant" and "assistant" not in r[1:] for r in roles.values())
    assert all(len(f) == 1 for f in finishes.values())  # one finish chunk per choice
    assert all(texts.values())
    assert counted == usage.completion_tokens
    assert usage.prompt_tokens == _prompt_tokens(client)
    _check_ledger(server, request_id, usage, "chat.completions")


def test_async_completions_with_legacy_logprobs(server: Server) -> None:
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    async def scenario() -> tuple[Any, Any, str]:
        full = await client.completions.create(
            model="smollm2", prompt=PROMPT, n=2, max_tokens=4, temperature=0, logprobs=2
        )
        stream = await client.completions.create(
            model="smollm2", prompt=PROMPT, n=2, max_tokens=4, temperature=0, logprobs=2,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        await client.close()
        return full, chunks, stream.response.headers["x-request-id"]

    full, chunks, stream_id = asyncio.run(scenario())
    assert [c.index for c in full.choices] == [0, 1] and full.usage.completion_tokens == 8
    for choice in full.choices:
        lp = choice.logprobs
        assert "Paris" in choice.text and choice.finish_reason == "length"
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert value <= 0 and all(v <= 0 for v in top.values())
            assert top[token] == pytest.approx(value) and len(top) <= 3
            assert max(top.values()) == pytest.approx(value)  # greedy
    _check_ledger(server, full._request_id, full.usage, "completions")

    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 8
    streamed: dict[int, str] = {0: "", 1: ""}
    offsets: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] += choice.text
        if choice.logprobs is not None:
            offsets[choice.index] += choice.logprobs.text_offset
    assert streamed == {0: full.choices[0].text, 1: full.choices[1].text}
    assert offsets == {i: c.logprobs.text_offset for i, c in enumerate(full.choices)}
    _check_ledger(server, stream_id, usage, "completions")


def test_bad_n_and_logprobs_are_400s_naming_the_parameter(server: Server) -> None:
    client = _client(server)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"user": "u" * 257}, "user"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="smollm2", messages=MESSAGES, **extra)
        assert info.value.param == param


def test_native_invoke(server: Server) -> None:
    url = f"{server.url}/v1/deployments/smollm2/invoke"
    body = {"prompt": PROMPT, "params": {"max_tokens": 4, "temperature": 0, "n": 2, "logprobs": 1}}
    r = httpx.post(url, json=body, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["object"], got["id"], got["deployment"]) == (
        "invocation",
        r.headers["x-request-id"],
        "smollm2",
    )
    outputs, usage = got["outputs"], got["usage"]
    assert [o["index"] for o in outputs] == [0, 1]
    for o in outputs:
        assert "Paris" in o["text"] and o["finish_reason"] == "length"
        assert len(o["token_ids"]) == len(o["logprobs"]) == 4
        assert [e["token_id"] for e in o["logprobs"]] == o["token_ids"]
        assert all(len(e["top_logprobs"]) == 1 and e["logprob"] <= 0 for e in o["logprobs"])
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert "cached_tokens" in usage["prompt_tokens_details"]
    row = server.ledger_row(got["id"])
    assert (row.prompt_tokens, row.completion_tokens, row.endpoint) == (
        usage["prompt_tokens"],
        8,
        "invoke",
    )


def test_native_invoke_streams_ndjson(server: Server) -> None:
    url = f"{server.url}/v1/deployments/smollm2/invoke"
    body = {"messages": MESSAGES, "params": {"max_tokens": 5, "n": 2, "seed": 3}, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        request_id = r.headers["x-request-id"]
        lines = [json.loads(line) for line in r.iter_lines() if line]
    final, deltas = lines[-1], lines[:-1]
    assert set(final) == {"usage", "finish_reasons"}
    assert len(final["finish_reasons"]) == 2
    assert all(f in ("stop", "length") for f in final["finish_reasons"])
    assert all(set(d) == {"index", "text", "token_ids"} for d in deltas)
    assert {d["index"] for d in deltas} == {0, 1}
    completion = final["usage"]["completion_tokens"]
    assert completion == sum(len(d["token_ids"]) for d in deltas)
    row = server.ledger_row(request_id)
    assert (row.completion_tokens, row.prompt_tokens) == (
        completion,
        final["usage"]["prompt_tokens"],
    )


def test_native_invoke_errors(server: Server) -> None:
    def post(name: str, body: Any) -> dict[str, Any]:
        r = httpx.post(f"{server.url}/v1/deployments/{name}/invoke", json=body, timeout=60)
        assert r.status_code in (400, 404), r.text
        return {"status": r.status_code, **r.json()["error"]}

    err = post("ghost", {"prompt": "hi"})
    assert (err["status"], err["code"]) == (404, "deployment_not_found")
    assert post("smollm2", {"prompt": "hi", "messages": MESSAGES})["param"] == "messages"
    assert post("smollm2", {})["param"] == "prompt"
    err = post("smollm2", {"prompt": "hi", "params": {"n": 0}})
    assert (err["status"], err["param"]) == (400, "params.n") and "`params.n`" in err["message"]
    assert post("smollm2", {"prompt": "hi", "params": {"best_of": 2}})["param"] == "params.best_of"
