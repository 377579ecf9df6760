"""Streaming text out of SmolLM2's real byte-level BPE tokenizer: what a client reads is
exactly the decoded answer, never half a character and never any part of a stop string."""

from __future__ import annotations

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
