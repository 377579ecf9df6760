"""Keep the garbage collector's full passes off the token path.

CPython's cyclic collector walks every tracked object of the oldest generation on a full
pass, with the GIL held: in the control plane (SQLAlchemy, Starlette, prometheus-client,
~100,000 objects after start-up) one such pass measured 15-55 ms under load, stalling every
stream at once, a few times a minute. Nearly all of those objects live as long as the
process, so after start-up (and around model loads, in a worker) they are collected once and
moved out of the collector's sight with :func:`gc.freeze`; later full passes walk only what
was made since. Requests' own garbage is young and still collected as before.

Frozen objects are never collected, so whoever drops long-lived objects that may sit in
reference cycles (a worker unloading a model: its weights must not stay in memory) settles
again with ``thaw=True``. At exit everything is thawed, so the interpreter's last collection
still finalizes it.
"""

from __future__ import annotations

import atexit
import gc

_at_exit = False


def settle_heap(thaw: bool = True) -> int:
    """Collect, then exempt every object alive now from later passes; returns how many
    objects are frozen.

    ``thaw``: first thaw what earlier calls froze, so that what became garbage among it is
    collected too (a full pass over everything: ~0.1-0.2 s in a worker). Without it only
    what was made since the last call is walked (milliseconds)."""
    global _at_exit
    if not _at_exit:
        atexit.register(gc.unfreeze)
        _at_exit = True
    if thaw:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
