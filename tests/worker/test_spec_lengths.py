"""Per-request proposal lengths (worker/engine/spec/lengths.py): grow while proposals are
accepted, shrink to what was sustained, pause after rejections with a growing pause."""

from __future__ import annotations

import pytest

from hotpool.worker.engine.spec.lengths import MAX_PAUSE, ProposalLengths


def test_a_new_request_proposes_the_most_and_grows_back_after_a_partial_hit() -> None:
    lengths = ProposalLengths(6)
    assert lengths.next("a") == 6
    lengths.observe("a", 6, 2)  # two kept: try three
    assert lengths.next("a") == 3
    lengths.observe("a", 3, 3)  # all kept: grow by two, up to the most
    assert lengths.next("a") == 5
    lengths.observe("a", 5, 5)
    assert lengths.next("a") == 6
    assert lengths.next("b") == 6  # per request


def test_rejections_pause_proposals_longer_each_time_and_an_accept_ends_it() -> None:
    lengths = ProposalLengths(4)
    pauses = []
    for _ in range(7):
        lengths.observe("a", lengths.next("a") or 1, 0)
        skipped = 0
        while lengths.next("a") == 0:
            skipped += 1
        pauses.append(skipped)
    assert pauses == [1, 2, 4, 8, 16, MAX_PAUSE, MAX_PAUSE]
    lengths.observe("a", 1, 1)
    assert lengths.next("a") == 3  # the pauses are over
    lengths.observe("a", 3, 0)
    assert [lengths.next("a") for _ in range(2)] == [0, 1]  # back to the shortest pause


def test_release_forgets_and_nothing_proposed_changes_nothing() -> None:
    lengths = ProposalLengths(4)
    lengths.observe("a", 4, 0)
    lengths.release("a")
    assert lengths.next("a") == 4
    lengths.observe("a", 0, 0)
    assert lengths.next("a") == 4
    with pytest.raises(ValueError, match="max_tokens"):
        ProposalLengths(0)


def test_without_pauses_a_rejected_request_keeps_guessing_one_token() -> None:
    """Where verification replays (programs, CUDA graphs) a rejected position is cheap: a
    request that stopped copying keeps proposing its one-token guesses."""
    lengths = ProposalLengths(4)
    lengths.pauses = False
    for _ in range(5):
        lengths.observe("a", lengths.next("a"), 0)
        assert lengths.next("a") == 1
    lengths.observe("a", 1, 1)
    assert lengths.next("a") == 3
