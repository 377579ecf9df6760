"""What a client sees when it sends OpenAI-shaped bodies: what is accepted, the defaults it
gets, and a 400 naming the parameter for everything hotpool cannot honour."""

from __future__ import annotations

from typing import Any

import pytest

from hotpool.billing.deployments import DeploymentSpec
from hotpool.platform.answer_bounds import bounded
from hotpool.platform.errors import APIError
from hotpool.platform.schemas import parse_chat, parse_completion
from hotpool.worker.protocol import ChatMessage

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "Once upon a time"}
TEXT_A = {"type": "text", "text": "a"}


def test_minimal_chat_body_gets_openai_defaults() -> None:
    call = parse_chat(CHAT)
    assert call.endpoint == "chat.completions"
    assert call.model == "m"
    assert call.messages == (ChatMessage(role="user", content="hi"),)
    assert call.prompt is None
    assert call.stream is False
    assert call.include_usage is False
    p = call.params
    assert p.max_tokens is None  # chat: up to the context length
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (1.0, 1.0, 0, None, ())


def test_minimal_completion_body_defaults_to_16_tokens() -> None:
    call = parse_completion(COMPLETION)
    assert call.endpoint == "completions"
    assert call.prompt == "Once upon a time"
    assert call.messages is None
    # Left to the deployment's default_max_tokens, else OpenAI's 16 (answer_bounds).
    assert call.params.max_tokens is None
    assert bounded(call, DeploymentSpec("m", "file:///m")).params.max_tokens == 16


def test_full_chat_body_is_carried_through() -> None:
    call = parse_chat(
        {
            **CHAT,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [TEXT_A, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok", "name": "bot"},
            ],
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 40,
            "seed": 3,
            "stop": ["\n", "END"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "alice",
        }
    )
    assert call.messages == (
        ChatMessage(role="system", content="be brief"),  # developer is the system role
        ChatMessage(role="user", content="ab"),
        ChatMessage(role="assistant", content="ok", name="bot"),  # passed to the template
    )
    p = call.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.0, 0.5, 40, 3)
    assert p.stop == ("\n", "END")
    assert call.stream and call.include_usage
    assert call.user == "alice"


def test_max_completion_tokens_and_max_tokens_are_one_limit() -> None:
    assert parse_chat({**CHAT, "max_completion_tokens": 5}).params.max_tokens == 5
    assert parse_chat({**CHAT, "max_tokens": 6}).params.max_tokens == 6
    both = parse_chat({**CHAT, "max_tokens": 5, "max_completion_tokens": 5})
    assert both.params.max_tokens == 5
    assert (
        parse_chat({**CHAT, "max_tokens": None, "max_completion_tokens": 5}).params.max_tokens == 5
    )
    # two different limits: which was meant? A bad one beside a good one: still bad.
    for other in (100, "junk", 0, True):
        with pytest.raises(APIError) as err:
            parse_chat({**CHAT, "max_tokens": other, "max_completion_tokens": 5})
        assert err.value.status == 400 and err.value.param == "max_tokens"


def test_stop_string_and_single_prompt_list_are_accepted() -> None:
    call = parse_completion({**COMPLETION, "prompt": ["only one"], "stop": "\n\n"})
    assert call.prompt == "only one"
    assert call.params.stop == ("\n\n",)


def _rejects(parse: Any, body: Any, param: str | None, text: str = "") -> APIError:
    with pytest.raises(APIError) as info:
        parse(body)
    err = info.value
    assert err.status == 400
    assert err.param == param
    assert text in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": CHAT["messages"]}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": 3, "messages": CHAT["messages"]}, "model"),
        ({**CHAT, "messages": ["hi"]}, "messages[0]"),
        ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({**CHAT, "messages": [{"content": "x"}]}, "messages[0].role"),
        ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({**CHAT, "messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {
                **CHAT,
                "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": None}],
            },
            "messages[1].content",
        ),
        (
            {
                **CHAT,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                        ],
                    }
                ],
            },
            "messages[0].content",
        ),
        (
            {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls",
        ),
        ({**CHAT, "messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
        ({**CHAT, "messages": [{"role": "user", "content": "x", "name": ""}]}, "messages[0].name"),
        ({**CHAT, "tools": {}}, "tools"),
        ({**CHAT, "logit_bias": []}, "logit_bias"),
        ({**CHAT, "store": True}, "store"),
        ({**CHAT, "temprature": None}, "temprature"),  # not an OpenAI field: a typo, even null
        ({**CHAT, "temperature": True}, "temperature"),
        ({**CHAT, "temperature": "0.5"}, "temperature"),
        ({**CHAT, "temperature": -0.1}, "temperature"),
        ({**CHAT, "temperature": 2.01}, "temperature"),
        ({**CHAT, "top_p": 0}, "top_p"),
        ({**CHAT, "top_p": 1.5}, "top_p"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
        ({**CHAT, "max_tokens": True}, "max_tokens"),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({**CHAT, "seed": "7"}, "seed"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
        ({**CHAT, "frequency_penalty": -3}, "frequency_penalty"),
        ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
        ({**CHAT, "min_p": 1.5}, "min_p"),
        ({**CHAT, "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({**CHAT, "ignore_eos": "yes"}, "ignore_eos"),
        ({**CHAT, "logit_bias": {"50256": -100}}, "logit_bias"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**CHAT, "stop": [""]}, "stop"),
        ({**CHAT, "stop": [1]}, "stop"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({**CHAT, "stream": True, "stream_options": {"continuous_usage": True}}, "stream_options"),
        ({**CHAT, "prompt": "x"}, "prompt"),  # a completions field on chat
    ],
)
def test_chat_rejections_name_the_parameter(body: dict[str, Any], param: str) -> None:
    _rejects(parse_chat, body, param)


def test_unknown_field_is_rejected_like_openai() -> None:
    err = _rejects(parse_chat, {**CHAT, "temprature": 0.5}, "temprature")
    assert err.message == "Unrecognized request argument supplied: temprature"
    _rejects(
        parse_completion,
        {**COMPLETION, "messages": []},
        "messages",
        "Unrecognized request argument supplied",
    )


def test_unsupported_parameters_say_so() -> None:
    err = _rejects(parse_chat, {**CHAT, "logit_bias": {"1": 5}}, "logit_bias", "not supported")
    assert err.code == "unsupported_parameter"


def test_wrong_types_of_unsupported_parameters_are_type_errors() -> None:
    for field, value in (("tools", {}), ("logit_bias", [])):
        err = _rejects(parse_chat, {**CHAT, field: value}, field, "wrong type")
        assert err.code is None  # not "unsupported_parameter": the value is malformed


def test_a_response_message_sent_back_as_openai_dumps_it_is_accepted() -> None:
    """``response.choices[0].message.model_dump()`` carries OpenAI's other message fields as
    null (or empty), and SDKs send OpenAI's optional parameters as null: nothing is asked."""
    dumped = {
        "role": "assistant", "content": "Paris.", "refusal": None, "annotations": [],
        "audio": None, "function_call": None, "tool_calls": None,
    }  # fmt: skip
    body = {
        **CHAT,
        "messages": [{"role": "user", "content": "Capital?"}, dumped],
        "store": None, "metadata": None, "service_tier": None, "reasoning_effort": None,
    }  # fmt: skip
    call = parse_chat(body)
    assert call.messages is not None and call.messages[1] == ChatMessage("assistant", "Paris.")


def test_penalties_and_vllm_extensions_reach_the_engine() -> None:
    body = {**CHAT, "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.1,
            "min_p": 0.05, "top_k": 20, "min_tokens": 3, "ignore_eos": True}  # fmt: skip
    p = parse_chat(body).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.1)
    assert (p.min_p, p.top_k, p.min_tokens, p.ignore_eos) == (0.05, 20, 3, True)


@pytest.mark.parametrize("body", [None, [], "hi", 3])
def test_body_must_be_an_object(body: Any) -> None:
    _rejects(parse_chat, body, None, "JSON object")
    _rejects(parse_completion, body, None, "JSON object")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [[1, 2, 3]]}, "prompt"),
        ({"model": "m", "prompt": 42}, "prompt"),
        ({**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ({**COMPLETION, "echo": True}, "echo"),
        ({**COMPLETION, "suffix": "!"}, "suffix"),
        ({**COMPLETION, "best_of": 3}, "best_of"),
        ({**COMPLETION, "temperature": False}, "temperature"),
        ({**COMPLETION, "max_completion_tokens": 5}, "max_completion_tokens"),
    ],
)
def test_completion_rejections_name_the_parameter(body: dict[str, Any], param: str) -> None:
    _rejects(parse_completion, body, param)


@pytest.mark.parametrize("value", [0, 0.0, 2, 2.0, 1])
def test_temperature_bounds_are_inclusive(value: float) -> None:
    assert parse_chat({**CHAT, "temperature": value}).params.temperature == float(value)


def test_neutral_values_of_unsupported_parameters_are_accepted() -> None:
    call = parse_chat(
        {
            **CHAT,
            "n": 1,
            "logprobs": False,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "stop": None,
        }
    )
    assert call.params.stop == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", True),
        ("presence_penalty", False),
        ("frequency_penalty", False),
        ("repetition_penalty", True),
    ],
)
def test_booleans_do_not_pass_for_numbers(field: str, value: bool) -> None:
    with pytest.raises(APIError) as exc:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value})
    assert exc.value.status == 400 and exc.value.param == field


# --- n, logprobs, user ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 16])
def test_n_choices_up_to_16(n: int) -> None:
    assert parse_chat({**CHAT, "n": n}).params.n == n
    assert parse_completion({**COMPLETION, "n": n}).params.n == n


def test_n_defaults_to_one() -> None:
    assert parse_chat(CHAT).params.n == 1 and parse_chat({**CHAT, "n": None}).params.n == 1


@pytest.mark.parametrize("n", [0, -1, 17, 1000, 1.5, 2.0, "2", True, [2]])
def test_bad_n_is_a_400_naming_n(n: Any) -> None:
    _rejects(parse_chat, {**CHAT, "n": n}, "n")
    _rejects(parse_completion, {**COMPLETION, "n": n}, "n")


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),  # the sampled token's logprob only
        ({"logprobs": True, "top_logprobs": 0}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
        ({"logprobs": True, "top_logprobs": 20}, 20),
        ({"logprobs": False, "top_logprobs": None}, None),
    ],
)
def test_chat_logprobs_and_top_logprobs(extra: dict[str, Any], want: int | None) -> None:
    assert parse_chat({**CHAT, **extra}).params.logprobs == want


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ({"top_logprobs": 0}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
    ],
)
def test_bad_chat_logprobs_are_400s(extra: dict[str, Any], param: str) -> None:
    _rejects(parse_chat, {**CHAT, **extra}, param)


@pytest.mark.parametrize(("value", "want"), [(None, None), (0, 0), (1, 1), (5, 5)])
def test_completion_logprobs_take_the_legacy_count(value: int | None, want: int | None) -> None:
    assert parse_completion({**COMPLETION, "logprobs": value}).params.logprobs == want


@pytest.mark.parametrize("value", [6, 20, -1, 1.5, True, False, "3"])
def test_bad_completion_logprobs_are_400s(value: Any) -> None:
    _rejects(parse_completion, {**COMPLETION, "logprobs": value}, "logprobs")


def test_top_logprobs_is_a_chat_field_only() -> None:
    _rejects(parse_completion, {**COMPLETION, "top_logprobs": 2}, "top_logprobs")


@pytest.mark.parametrize("user", ["", "alice", "u" * 256])
def test_user_is_carried(user: str) -> None:
    assert parse_chat({**CHAT, "user": user}).user == user
    assert parse_completion({**COMPLETION, "user": user}).user == user


@pytest.mark.parametrize("user", ["u" * 257, 42, ["alice"], {"id": "alice"}, True])
def test_bad_user_is_a_400(user: Any) -> None:
    _rejects(parse_chat, {**CHAT, "user": user}, "user")
    _rejects(parse_completion, {**COMPLETION, "user": user}, "user")


def test_n_and_logprobs_together_with_a_seed() -> None:
    body = {**CHAT, "n": 3, "seed": 11, "logprobs": True, "top_logprobs": 2, "stream": True}
    p = parse_chat(body).params
    assert (p.n, p.seed, p.logprobs) == (3, 11, 2)
