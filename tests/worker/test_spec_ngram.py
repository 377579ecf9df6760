"""Prompt lookup proposes what followed the longest, most recent earlier match of the
sequence's tail, and its incremental index agrees with a rescan after every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotpool.worker.engine.spec.ngram import NgramProposer
from hotpool.worker.engine.spec.proposer import ProposalInput
from hotpool.worker.protocol import NgramConfig


def rescan(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The rule by its definition, scanning the whole sequence."""
    seq = list(tokens)
    size = len(seq)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = seq[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest first; the tail itself excluded
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


def propose(tokens: Sequence[int], k: int, **config: int) -> list[int]:
    proposer = NgramProposer(NgramConfig(**config))
    return proposer.propose([ProposalInput("r", tuple(tokens))], k)[0]


def test_proposes_what_followed_the_earlier_occurrence() -> None:
    assert propose([1, 2, 3, 4, 1, 2, 3], k=2) == [4, 1]
    # Up to the end of the sequence when fewer than k tokens follow the match.
    assert propose([1, 2, 3, 4, 1, 2, 3], k=10) == [4, 1, 2, 3]


def test_the_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    seq = [5, 6, 7, 8, 9, 7, 0, 5, 6, 7]  # 7 last came before 0; 5 6 7 came before 8
    assert propose(seq, k=3) == [8, 9, 7]
    assert propose(seq, k=3, max_n=1) == [0, 5, 6]


def test_the_most_recent_occurrence_wins_among_equally_long_ones() -> None:
    assert propose([1, 2, 9, 1, 2, 8, 1, 2], k=3) == [8, 1, 2]


def test_a_repeating_tail_may_overlap_its_match() -> None:
    assert propose([3, 3, 3, 3], k=3) == [3]  # 3 3 3 occurred at 0..2, followed by one 3


def test_nothing_is_proposed_without_a_match() -> None:
    assert propose([1, 2, 3, 4, 5], k=4) == []
    assert propose([7], k=4) == []
    assert propose([], k=4) == []
    assert propose([1, 2, 3, 1], k=4, min_n=2) == []  # only a 1-gram matches
    assert propose([1, 2, 3, 1], k=4) == [2, 3, 1]


def test_k_caps_the_proposal_and_zero_proposes_nothing() -> None:
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    assert [len(propose(seq, k)) for k in range(8)] == [0, 1, 2, 3, 4, 5, 6, 6]
    with pytest.raises(ValueError, match="k must be"):
        propose(seq, -1)


def test_one_list_per_request_in_order_with_prompt_and_output_joined() -> None:
    proposer = NgramProposer()
    out = proposer.propose(
        [
            ProposalInput("a", (1, 2, 3, 4), [1, 2]),  # the match spans prompt and output
            ProposalInput("b", (9, 8, 7)),
            ProposalInput("c", (), [5, 6, 5]),
        ],
        k=2,
    )
    assert out == [[3, 4], [], [6, 5]]
    assert proposer.num_tracked == 3
    proposer.release("a")
    proposer.release("unknown")
    assert proposer.num_tracked == 2


def test_a_sequence_that_did_not_grow_is_indexed_afresh() -> None:
    proposer = NgramProposer()
    assert proposer.propose([ProposalInput("r", (1, 2, 3, 1))], 2) == [[2, 3]]
    # Shorter than before, then same length with another last token: a reused id.
    assert proposer.propose([ProposalInput("r", (4, 5, 4))], 2) == [[5, 4]]
    assert proposer.propose([ProposalInput("r", (4, 5, 6))], 2) == [[]]
    assert proposer.propose([ProposalInput("r", (4, 5, 6, 5))], 2) == [[6, 5]]


def test_bad_config_and_token_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramConfig(min_n=0)
    with pytest.raises(ValueError, match="max_n"):
        NgramConfig(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="token ids"):
        propose([1, -2, 1], 2)
    with pytest.raises(ValueError, match="token ids"):
        propose([1, 2**32, 1], 2)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=120),
    cuts=st.lists(st.integers(0, 20), min_size=1, max_size=40),
    ks=st.lists(st.integers(0, 6), min_size=1, max_size=40),
    sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    big=st.booleans(),
)
def test_incremental_index_equals_a_rescan_at_every_step(
    tokens: list[int], cuts: list[int], ks: list[int], sizes: tuple[int, int], big: bool
) -> None:
    """Tokens arrive in chunks of any size (a prompt, decode steps, several accepted
    tokens); after each chunk the proposal is the rescan's. Small alphabets give many
    matches; large ids check the packed keys."""
    min_n, extra = sizes
    max_n = min_n + extra
    if big:
        tokens = [t * (2**31 + 12345) % 2**32 for t in tokens]
    proposer = NgramProposer(NgramConfig(min_n=min_n, max_n=max_n))
    prompt, output = tuple(tokens[: cuts[0] * 3]), []
    rest = iter(tokens[len(prompt) :])
    for step, cut in enumerate([0, *cuts[1:]]):
        output.extend(t for _, t in zip(range(cut), rest, strict=False))
        k = ks[step % len(ks)]
        got = proposer.propose([ProposalInput("r", prompt, output)], k)[0]
        assert got == rescan([*prompt, *output], k, min_n, max_n)


class CountingTokens(Sequence[int]):
    """A token list that counts how many tokens a reader takes from it."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.reads = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        got = self.tokens[i]
        self.reads += len(got) if isinstance(got, list) else 1
        return got


def test_a_decode_step_reads_only_the_new_tokens_not_the_sequence() -> None:
    """The index is built once from the prompt; each later step reads O(1) tokens, however
    long the prompt (a rescan would read all of them every step)."""
    prompt = CountingTokens([i % 5000 for i in range(20_000)])
    output = CountingTokens([])
    proposer = NgramProposer()
    first = proposer.propose([ProposalInput("r", prompt, output)], 4)
    assert first == [[0, 1, 2, 3]]  # 19999 % 5000 = 4999 last came before 0 1 2 3
    assert prompt.reads == 20_000
    prompt.reads = 0
    for t in [0, 1, 2, 3, 4]:
        output.tokens.append(t)
        proposer.propose([ProposalInput("r", prompt, output)], 4)
    assert prompt.reads <= 1  # the last prompt token, checked once when output was empty
    assert output.reads <= 5 * 2
    assert proposer.propose([ProposalInput("r", prompt, output)], 4) == [[5, 6, 7, 8]]
