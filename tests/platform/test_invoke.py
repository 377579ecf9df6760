"""How the invoker decides that a request of n choices is over, and what it bills."""

from __future__ import annotations

from hotpool.platform.invoke import _Tally, _tally_event
from hotpool.worker.protocol import GenerateEvent, Usage


def test_the_request_finishes_when_every_choice_has() -> None:
    t = _Tally(n=2)
    _tally_event(t, GenerateEvent("a", (1,), None, Usage(5, 1), index=1))
    _tally_event(t, GenerateEvent("b", (2,), "stop", Usage(5, 2), index=1))
    assert t.finish is None  # choice 0 is still running: cutting now bills `partial`
    _tally_event(t, GenerateEvent("c", (3,), "length", Usage(5, 3), index=0))
    assert (t.finish, t.status, t.usage) == ("length", "completed", Usage(5, 3))


def test_one_failed_choice_fails_the_request() -> None:
    t = _Tally(n=3)
    _tally_event(t, GenerateEvent("a", (1,), "stop", Usage(5, 1), index=0))
    _tally_event(t, GenerateEvent("", (), "error", Usage(5, 1), "NaN logits", index=2))
    assert (t.finish, t.status, t.error) == ("error", "error", "NaN logits")


def test_a_single_choice_finishes_as_before() -> None:
    t = _Tally()
    _tally_event(t, GenerateEvent("x", (1,), "stop", Usage(2, 1)))
    assert (t.finish, t.status, t.error) == ("stop", "completed", None)
