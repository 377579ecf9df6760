"""Token logprobs in the shapes OpenAI clients parse: chat's list of entries with bytes, the
legacy completions columns with text offsets that run on across streamed chunks."""

from __future__ import annotations

from hotpool.platform.logprobs import CompletionLogprobs, chat_logprobs, native_logprobs
from hotpool.worker.protocol import PositionLogprobs, TokenLogprob

HELLO = TokenLogprob(1, "Hello", -0.5, tuple(b"Hello"))
HI = TokenLogprob(2, "Hi", -1.5, tuple(b"Hi"))
BANG = TokenLogprob(3, "!", -0.1, (33,))
HALF = TokenLogprob(4, "\ufffd", -2.0, (0xF0, 0x9F))  # the first bytes of an emoji
POSITIONS = [PositionLogprobs(HI, (HELLO, HI)), PositionLogprobs(BANG, (BANG,))]


def test_chat_shape() -> None:
    assert chat_logprobs(POSITIONS[:1]) == {
        "content": [
            {
                "token": "Hi",
                "logprob": -1.5,
                "bytes": [72, 105],
                "top_logprobs": [
                    {"token": "Hello", "logprob": -0.5, "bytes": [72, 101, 108, 108, 111]},
                    {"token": "Hi", "logprob": -1.5, "bytes": [72, 105]},
                ],
            }
        ]
    }
    partial = chat_logprobs([PositionLogprobs(HALF)])["content"][0]
    assert (partial["token"], partial["bytes"], partial["top_logprobs"]) == (
        "\ufffd",
        [240, 159],
        [],
    )


def test_completion_columns_include_the_sampled_token_and_offsets_run_on() -> None:
    legacy = CompletionLogprobs()
    first = legacy.chunk(POSITIONS)
    assert first == {
        "tokens": ["Hi", "!"],
        "token_logprobs": [-1.5, -0.1],
        "top_logprobs": [{"Hello": -0.5, "Hi": -1.5}, {"!": -0.1}],
        "text_offset": [0, 2],
    }
    second = legacy.chunk([PositionLogprobs(HELLO)])  # logprobs=0: only the sampled token
    assert second["top_logprobs"] == [{"Hello": -0.5}] and second["text_offset"] == [3]


def test_native_shape_carries_token_ids() -> None:
    (entry,) = native_logprobs(POSITIONS[1:])
    assert entry == {
        "token_id": 3, "token": "!", "logprob": -0.1, "bytes": [33],
        "top_logprobs": [{"token_id": 3, "token": "!", "logprob": -0.1, "bytes": [33]}],
    }  # fmt: skip
