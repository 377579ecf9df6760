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


def test_completion_tokens_of_part_of_a_character_show_their_bytes() -> None:
    """An emoji split over two tokens: each shows as OpenAI shows it (``bytes:\\xNN``), and
    the offsets count the text's characters, so ``text[offset]`` is where each token's text
    begins (the emoji's two tokens both point at it)."""
    rest = TokenLogprob(5, "\ufffd", -0.3, (0x98, 0x80))
    legacy = CompletionLogprobs()
    out = legacy.chunk([PositionLogprobs(BANG), PositionLogprobs(HALF, (HALF, BANG))])
    out2 = legacy.chunk([PositionLogprobs(rest), PositionLogprobs(HI)])
    assert out["tokens"] == ["!", "bytes:\\xf0\\x9f"]
    assert out["top_logprobs"][1] == {"bytes:\\xf0\\x9f": -2.0, "!": -0.1}
    assert out2["tokens"] == ["bytes:\\x98\\x80", "Hi"]
    text = "!\U0001f600Hi"
    assert out["text_offset"] + out2["text_offset"] == [0, 1, 1, 2]
    assert text[2:] == "Hi"
