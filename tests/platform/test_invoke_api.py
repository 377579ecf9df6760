"""The native invoke body: one of prompt and messages, sampling parameters under ``params``
checked by the same rules as the OpenAI routes, each 400 naming ``params.<name>``."""

from __future__ import annotations

from typing import Any

import pytest

from hotpool.billing.deployments import DeploymentSpec
from hotpool.platform.answer_bounds import bounded
from hotpool.platform.errors import APIError
from hotpool.platform.invoke_api import parse_invoke
from hotpool.worker.protocol import ChatMessage

HI = [{"role": "user", "content": "hi"}]


def test_prompt_with_every_parameter() -> None:
    params = {"max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1,
              "stop": ["\n"], "seed": 3, "presence_penalty": 0.5, "frequency_penalty": 0.25,
              "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True, "n": 4,
              "logprobs": 20}  # fmt: skip
    call = parse_invoke({"prompt": "Once", "params": params, "stream": True}, "dep")
    assert (call.endpoint, call.model, call.prompt, call.messages) == (
        "invoke",
        "dep",
        "Once",
        None,
    )
    assert call.stream and not call.include_usage
    p = call.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (8, 0.5, 0.9, 40, 0.1)
    assert (p.stop, p.seed, p.min_tokens, p.ignore_eos, p.n, p.logprobs) == (
        ("\n",), 3, 2, True, 4, 20,
    )  # fmt: skip
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)


def test_defaults_follow_the_openai_routes() -> None:
    # max_tokens is left to the deployment's bounds, as on the OpenAI routes: without any,
    # 16 for a prompt and up to the context for messages (platform/answer_bounds.py).
    spec = DeploymentSpec("dep", "file:///dep")
    prompt = bounded(parse_invoke({"prompt": "Once"}, "dep"), spec)
    assert (prompt.params.max_tokens, prompt.params.n, prompt.params.logprobs) == (16, 1, None)
    assert not prompt.stream
    chat = bounded(parse_invoke({"messages": HI}, "dep"), spec)
    assert chat.messages == (ChatMessage("user", "hi"),) and chat.params.max_tokens is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": None, "messages": None}, "prompt"),
        ({"prompt": "x", "messages": HI}, "messages"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "params": [1]}, "params"),
        ({"prompt": "x", "model": "m"}, "model"),
        ({"prompt": "x", "params": {"n": 0}}, "params.n"),
        ({"prompt": "x", "params": {"n": 17}}, "params.n"),
        ({"prompt": "x", "params": {"n": 1.5}}, "params.n"),
        ({"prompt": "x", "params": {"logprobs": 21}}, "params.logprobs"),
        ({"prompt": "x", "params": {"logprobs": True}}, "params.logprobs"),
        ({"prompt": "x", "params": {"max_tokens": 0}}, "params.max_tokens"),
        ({"prompt": "x", "params": {"temperature": 3}}, "params.temperature"),
        ({"prompt": "x", "params": {"min_tokens": 5, "max_tokens": 2}}, "params.min_tokens"),
        ({"prompt": "x", "params": {"stop": [""]}}, "params.stop"),
        ({"prompt": "x", "params": {"best_of": 2}}, "params.best_of"),
        ({"prompt": "x", "params": {"stream": True}}, "params.stream"),
    ],
)
def test_bad_bodies_name_the_parameter(body: Any, param: str) -> None:
    with pytest.raises(APIError) as info:
        parse_invoke(body, "dep")
    assert (info.value.status, info.value.param) == (400, param)
    if param.startswith("params.") and "Unrecognized" not in info.value.message:
        assert f"`{param}`" in info.value.message


@pytest.mark.parametrize("body", [None, [], "x"])
def test_body_must_be_an_object(body: Any) -> None:
    with pytest.raises(APIError) as info:
        parse_invoke(body, "dep")
    assert info.value.status == 400
