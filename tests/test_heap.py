"""settle_heap: start-up's objects leave the collector's full passes; later garbage does not."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from hotpool.heap import settle_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test process is collected as usual


def test_objects_alive_when_settled_are_exempt_from_later_collections() -> None:
    node = Node()
    alive = weakref.ref(node)
    frozen = settle_heap()
    assert frozen == gc.get_freeze_count() > 0
    del node  # garbage now, but frozen: a full pass does not walk it
    gc.collect()
    assert alive() is not None
    settle_heap()  # thaws first: what became garbage since the last call is collected
    assert alive() is None


def test_garbage_made_after_settling_is_still_collected() -> None:
    settle_heap()
    node = Node()
    gone = weakref.ref(node)
    del node
    gc.collect()
    assert gone() is None


def test_without_thawing_only_what_is_new_is_walked_and_frozen() -> None:
    old = Node()
    old_ref = weakref.ref(old)
    settle_heap()
    del old  # garbage among the frozen: a settle without thawing leaves it be
    new = Node()
    frozen = settle_heap(thaw=False)
    # What it returns is the count it left; another thread of the process (a test server's)
    # may free a frozen object since, never freeze one: the count can only have gone down.
    assert 0 < gc.get_freeze_count() <= frozen and old_ref() is not None
    gone = weakref.ref(new)
    del new  # frozen by the second settle
    gc.collect()
    assert gone() is not None
    settle_heap()  # thawing collects both
    assert old_ref() is None and gone() is None
