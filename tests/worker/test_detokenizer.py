"""Streaming text out of SmolLM2's real byte-level BPE tokenizer: what a client reads is
exactly the decoded answer, never half a character and never any part of a stop string."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from hotpool.worker.detokenizer import IncrementalDetokenizer
from hotpool.worker.protocol import ChatMessage
from hotpool.worker.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok(smollm2_snapshot_bf16: Path) -> TextTokenizer:
    return TextTokenizer(smollm2_snapshot_bf16)


def stream(
    tok: TextTokenizer, ids: Sequence[int], stop: Sequence[str] = ()
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``ids`` one at a time; the pieces a client would receive (flush last)."""
    detok = IncrementalDetokenizer(tok, stop)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    return pieces, detok


TEXTS = [
    "Hello world",
    "Llamas 🦙 and alpacas 🦙🦙 are camelids.",
    "café, naïve, Zürich — “quotes” and 日本語のテキスト",
    "line one\n\n  indented\tline two\n",
    "emoji at the end 🎉",
    "🎉",
    "a" * 50,
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_reproduce_the_full_decode(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces, detok = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all(REPLACEMENT not in p for p in pieces)
    assert not detok.stopped


def test_plain_text_is_released_token_by_token(tok: TextTokenizer) -> None:
    # Without stop strings nothing is held back: each token reaches the client at once.
    ids = tok.encode("Hello world, how are you")
    pieces, _ = stream(tok, ids)
    assert pieces[:-1] == [tok.decode([i]) for i in ids]
    assert pieces[-1] == ""


def test_a_split_emoji_arrives_whole(tok: TextTokenizer) -> None:
    ids = tok.encode("🦙 llamas")
    assert tok.decode(ids[:1]).endswith(REPLACEMENT)  # the emoji really is split
    pieces, _ = stream(tok, ids)
    emoji_pieces = [p for p in pieces if "🦙" in p]
    assert emoji_pieces == ["🦙"]
    assert pieces.index("🦙") > 0  # released only when its last byte arrived
    assert all(p == "" for p in pieces[: pieces.index("🦙")])


def test_generation_ending_mid_character_emits_no_replacement_char(tok: TextTokenizer) -> None:
    ids = tok.encode("ok 🦙")
    cut = ids[:-1]  # the emoji's last byte never comes
    assert tok.decode(cut).endswith(REPLACEMENT)
    pieces, _ = stream(tok, cut)
    # The space came in the same token as the emoji's first byte: it is out, the half
    # emoji is not.
    assert "".join(pieces) == "ok "
    assert all(REPLACEMENT not in p for p in pieces)


def test_stop_string_spanning_two_tokens(tok: TextTokenizer) -> None:
    ids = tok.encode("Hello world, and more text after it")
    assert [tok.decode([i]) for i in ids[:2]] == ["Hello", " world"]
    detok = IncrementalDetokenizer(tok, ["lo wor"])
    out = [detok.push([ids[0]])]
    assert not detok.stopped
    out.append(detok.push([ids[1]]))
    assert detok.stopped  # on the very token that completed it
    # Nothing after the stop string ever comes out, whatever else is pushed.
    out += [detok.push([i]) for i in ids[2:]]
    out.append(detok.flush())
    assert "".join(out) == "Hel"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The cat sat on the mat. The end.", ["mat. The"], "The cat sat on the "),
        ("The cat sat on the mat. The end.", ["\n", "sat"], "The cat "),
        ("The cat sat on the mat. The end.", ["The"], ""),
        ("The cat sat on the mat. The end.", ["end."], "The cat sat on the mat. The "),
        ("Answer: 42\n\nQuestion: why?", ["\n\n"], "Answer: 42"),
        ("Llamas 🦙 are fluffy", ["🦙"], "Llamas "),
        ("Llamas 🦙 are fluffy", ["s 🦙 a"], "Llama"),
    ],
)
def test_stop_strings_are_cut_exactly(
    tok: TextTokenizer, text: str, stop: list[str], expected: str
) -> None:
    pieces, detok = stream(tok, tok.encode(text), stop)
    assert detok.stopped
    assert "".join(pieces) == expected


@pytest.mark.parametrize(
    "text",
    [
        "The cat sat on the mat! The end.",  # "mat" starts the stop string, "!" breaks it
        "The cat sat on the mat. Th",  # generation ends inside a would-be stop string
    ],
)
def test_a_near_miss_is_released_in_full(tok: TextTokenizer, text: str) -> None:
    stop = "mat. The"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [stop])
    sent = ""
    for n, i in enumerate(ids, start=1):
        sent += detok.push([i])
        # Whatever is out is final (a prefix of the text), and at most the stop string's
        # length minus one is held back for the next tokens to complete.
        assert text.startswith(sent)
        assert len(tok.decode(ids[:n])) - len(sent) <= len(stop) - 1
    sent += detok.flush()
    assert not detok.stopped
    assert sent == text


def test_no_stop_string_ever_leaks_partially(tok: TextTokenizer) -> None:
    # Every prefix of the stop string ends the text at some point of a long stream; the
    # client must never have received any of the stop string's characters.
    text = "abc <|user|> and <|use more <|us text <|u then <| and finally <|user|> tail"
    stop = "<|user|>"
    pieces, detok = stream(tok, tok.encode(text), [stop])
    assert detok.stopped
    assert "".join(pieces) == "abc "


def test_earliest_of_several_stop_strings_wins(tok: TextTokenizer) -> None:
    # " world" completes both stop strings; "lo w" starts earlier, so none of it may reach
    # the client even though "world" is listed first.
    ids = tok.encode("Hello world")
    assert [tok.decode([i]) for i in ids] == ["Hello", " world"]
    pieces, detok = stream(tok, ids, ["world", "lo w"])
    assert detok.stopped
    assert "".join(pieces) == "Hel"


def test_stop_is_seen_on_the_token_that_completes_it(tok: TextTokenizer) -> None:
    # " \xf0" is one token: it completes the stop string "é " and starts an emoji. The engine
    # must learn of the stop now, not after the emoji's remaining bytes were generated.
    ids = tok.encode("café 🎉")
    pieces = [tok.decode([i]) for i in ids]
    end = pieces.index("é") + 1  # the next token is a space plus the emoji's first byte
    assert tok.decode(ids[: end + 1]).endswith(REPLACEMENT)
    detok = IncrementalDetokenizer(tok, ["é "])
    out = "".join(detok.push([i]) for i in ids[: end + 1])
    assert detok.stopped
    assert out + detok.flush() == "caf"


def test_empty_stop_strings_are_ignored(tok: TextTokenizer) -> None:
    pieces, detok = stream(tok, tok.encode("Hello world"), ["", ""])
    assert not detok.stopped
    assert "".join(pieces) == "Hello world"


def test_pushing_several_tokens_at_once(tok: TextTokenizer) -> None:
    ids = tok.encode("one two three four")
    detok = IncrementalDetokenizer(tok, ["three"])
    out = detok.push(ids) + detok.flush()
    assert detok.stopped
    assert out == "one two "


MULTIBYTE = [
    "你好，世界！今天天气很好。我们去公园散步吧。",  # noqa: RUF001 (real Chinese punctuation)
    "Family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 thumbs 👍🏽 done",
    "混合 text 和 emoji 🦙🎉，还有日本語と한국어。",  # noqa: RUF001
]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_chinese_and_emoji_stream_intact(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text)
    # Most of these characters really are split over several byte-level tokens.
    assert sum(tok.decode([i]).endswith(REPLACEMENT) for i in ids) > len(ids) // 3
    pieces, _ = stream(tok, ids)
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) == text
    # Each character goes out whole as soon as its last byte arrives, not later.
    for n in range(1, len(ids) + 1):
        assert "".join(pieces[:n]) == tok.decode(ids[:n]).rstrip(REPLACEMENT)


def _long_output(tok: TextTokenizer, n: int) -> list[int]:
    para = (
        "Llamas 🦙 live in the Andes; 骆驼和羊驼是南美洲的动物。 They hum, spit and carry loads.\n"
    )
    ids = tok.encode(para * (n // 10))[:n]
    assert len(ids) == n
    return ids


def test_a_long_output_round_trips(tok: TextTokenizer) -> None:
    ids = _long_output(tok, 2000)
    pieces, detok = stream(tok, ids, ["<|user|>", "never"])
    assert not detok.stopped
    assert "".join(pieces) == tok.decode(ids).rstrip(REPLACEMENT)


def test_streaming_time_is_linear_in_output_length(tok: TextTokenizer) -> None:
    # Re-decoding everything on each token makes the last tokens of a long output several
    # times slower than the first; windowed decoding keeps every push about equally cheap.
    ids = _long_output(tok, 2000)
    first, last = float("inf"), float("inf")
    for _ in range(3):  # best of three: scheduler noise only ever adds time
        detok = IncrementalDetokenizer(tok, ["<|user|>"])
        marks = []
        for i in ids:
            marks.append(time.perf_counter())
            detok.push([i])
        marks.append(time.perf_counter())
        first = min(first, marks[400] - marks[0])
        last = min(last, marks[-1] - marks[-401])
    assert last < 3 * first, f"last 400 tokens took {last / first:.1f}x the first 400"


@pytest.mark.parametrize(
    ("text", "stop", "spans"),
    [
        ("The answer is 42.\n### Instruction: next", "\n### Instruction", 3),
        ("User: hi\nAssistant: hello", "Assistant:", 3),
        ("User: hi\nAssistant: hello", "hi\nAss", 3),
        ("The answer is 42.\n### Instruction: next", "42", 2),
        ("你好，世界！今天天气很好。", "世界", 5),  # noqa: RUF001
    ],
)
def test_stop_string_spanning_tokens_never_streams_partly(
    tok: TextTokenizer, text: str, stop: str, spans: int
) -> None:
    ids = tok.encode(text)
    expected = text[: text.index(stop)]
    # Tokens [start, end) are the ones the stop string's characters come from.
    start = next(n for n in range(len(ids)) if len(tok.decode(ids[: n + 1])) > len(expected))
    end = next(n for n in range(len(ids) + 1) if tok.decode(ids[:n]).find(stop) != -1)
    assert end - start == spans
    detok = IncrementalDetokenizer(tok, [stop])
    sent = ""
    for n, i in enumerate(ids, start=1):
        sent += detok.push([i])
        assert expected.startswith(sent)  # never a character of the stop string
        assert detok.stopped == (n >= end)  # on the very token that completes it
    assert sent + detok.flush() == expected


def test_chat_template_renders_smollm2_format(tok: TextTokenizer) -> None:
    assert tok.has_chat_template
    text = tok.apply_chat_template(
        [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi!")]
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_adds_smollm2_default_system_prompt(tok: TextTokenizer) -> None:
    text = tok.apply_chat_template([ChatMessage(role="user", content="Hello")])
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nHello<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt
    # The rendered prompt tokenizes with the chat markers as single special tokens.
    ids = tok.encode(text)
    im_start = tok.encode("<|im_start|>")
    assert len(im_start) == 1
    assert ids.count(im_start[0]) == 3


def test_end_of_turn_token_is_eos_and_not_decoded(tok: TextTokenizer) -> None:
    (eos,) = tok.eos_token_ids
    assert tok.encode("<|im_end|>") == [eos]
    ids = [*tok.encode("Done."), eos]
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == "Done."


def _until_min(tok: TextTokenizer, ids: list[int], stop: list[str], min_tokens: int) -> str:
    detok = IncrementalDetokenizer(tok, stop, min_tokens)
    out = ""
    for i in ids:
        out += detok.push([i])
        if detok.stopped:
            return out
    return out + detok.flush()


def _reference_cut(tok: TextTokenizer, ids: list[int], stop: list[str], min_tokens: int) -> str:
    """vLLM's rule, token by token on the whole text: after each token from the
    min_tokens-th on, the earliest stop string that ends in that token's text cuts there."""
    for n in range(max(1, min_tokens), len(ids) + 1):
        before, text = tok.decode(ids[: n - 1]), tok.decode(ids[:n])
        cuts = [
            at
            for s in stop
            if (at := text.find(s, max(0, len(before) - len(s) + 1))) != -1
            and at + len(s) > len(before)
        ]
        if cuts:
            return text[: min(cuts)]
    return tok.decode(ids)


@pytest.mark.parametrize("min_tokens", [0, 1, 2, 3, 5, 8, 40])
def test_min_tokens_hold_stop_strings_off_until_then(tok: TextTokenizer, min_tokens: int) -> None:
    """A stop string that ends within the first min_tokens - 1 tokens does not stop the
    text; one that ends in a later token (even if it began earlier) does."""
    ids = tok.encode("Here is a list. Here is a list of fruits: apple, pear. Here is more.")
    for stop in (["is"], [" is a"], ["Here", "list"], ["fruits: apple"], ["zzz"]):
        want = _reference_cut(tok, ids, stop, min_tokens)
        assert _until_min(tok, ids, stop, min_tokens) == want, (stop, min_tokens)
    assert _until_min(tok, ids, ["is"], 0) == "Here "
    assert _until_min(tok, ids, ["is"], 5).startswith("Here is a list. Here ")
