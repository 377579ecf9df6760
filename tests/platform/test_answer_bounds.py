"""A deployment's bounds on an answer's length, as every endpoint applies them."""

from __future__ import annotations

import pytest

from hotpool.billing.deployments import DeploymentSpec
from hotpool.platform.answer_bounds import answer_bounds_json, bounded
from hotpool.platform.errors import APIError
from hotpool.platform.invoke_api import parse_invoke
from hotpool.platform.schemas import parse_chat, parse_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "Once"}


def _spec(default: int | None = None, limit: int | None = None) -> DeploymentSpec:
    return DeploymentSpec("m", "file:///m", default_max_tokens=default, max_tokens_limit=limit)


def test_without_bounds_chat_runs_to_the_context_and_a_prompt_gets_16() -> None:
    assert bounded(parse_chat(CHAT), _spec()).params.max_tokens is None
    assert bounded(parse_completion(COMPLETION), _spec()).params.max_tokens == 16
    invoke = parse_invoke({"prompt": "Once"}, "m")
    assert bounded(invoke, _spec()).params.max_tokens == 16


def test_the_deployment_default_applies_to_every_endpoint_that_gives_none() -> None:
    spec = _spec(default=300)
    assert bounded(parse_chat(CHAT), spec).params.max_tokens == 300
    assert bounded(parse_completion(COMPLETION), spec).params.max_tokens == 300
    invoke = parse_invoke({"messages": CHAT["messages"]}, "m")
    assert bounded(invoke, spec).params.max_tokens == 300
    # What the request asks for stands (up to the limit).
    asked = parse_chat({**CHAT, "max_tokens": 5000})
    assert bounded(asked, spec).params.max_tokens == 5000


def test_the_limit_caps_the_defaults_and_refuses_more_with_the_parameter_named() -> None:
    spec = _spec(limit=8)
    assert bounded(parse_chat(CHAT), spec).params.max_tokens == 8
    assert bounded(parse_completion(COMPLETION), spec).params.max_tokens == 8  # under 16
    assert bounded(parse_chat({**CHAT, "max_tokens": 8}), spec).params.max_tokens == 8
    with pytest.raises(APIError) as err:
        bounded(parse_chat({**CHAT, "max_completion_tokens": 9}), spec)
    assert (err.value.status, err.value.param) == (400, "max_tokens")
    assert "at most 8" in err.value.message and "max_tokens_limit" in err.value.message
    with pytest.raises(APIError) as err:
        bounded(parse_invoke({"prompt": "x", "params": {"max_tokens": 9}}, "m"), spec)
    assert err.value.param == "params.max_tokens"


def test_min_tokens_above_the_default_is_a_400_not_a_worker_error() -> None:
    with pytest.raises(APIError) as err:
        bounded(parse_completion({**COMPLETION, "min_tokens": 20}), _spec())
    assert (err.value.status, err.value.param) == (400, "min_tokens")
    with pytest.raises(APIError):
        bounded(parse_chat({**CHAT, "min_tokens": 20}), _spec(default=10))


def test_a_default_above_the_limit_is_refused_and_both_are_reported() -> None:
    with pytest.raises(ValueError, match="default_max_tokens"):
        _spec(default=10, limit=5)
    with pytest.raises(ValueError, match="max_tokens_limit"):
        _spec(limit=0)
    assert answer_bounds_json(_spec(256, 4096)) == {
        "default_max_tokens": 256,
        "max_tokens_limit": 4096,
    }
