"""Keep the garbage collector's full passes off the token path.

CPython's cyclic collector walks every tracked object of the oldest generation on a full
pass, with the GIL held: in the control plane (SQLAlchemy, Starlette, prometheus-client,
~100,000 objects after start-up) one such pass measured 15-55 ms under load, stalling every
stream at once, a few times a minute. Nearly all of those objects live as long as the
process, so after start-up (and after a model load, in a worker) they are collected once and
moved out of the collector's sight with :func:`gc.freeze`; later full passes walk only what
was made since. Requests' own garbage is young and still collected as before.
"""

from __future__ import annotations

import gc


def settle_heap() -> int:
    """Collect once, then exempt every object alive now from later passes.

    Earlier frozen objects are thawed first, so what became garbage since the last call (an
    unloaded model, say) is collected too. Returns how many objects are now frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
