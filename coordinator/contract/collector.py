"""The cyclic garbage collector kept off the heaps it need not walk.

A worker that holds thousands of sessions has a large heap, and CPython's collector
walks all of it in a full (generation 2) pass: 0.4-1.7 s each in the scale bench's
workers (bench/HISTORY.md, 2026-12-02 17:05). Exporting or installing a checkpoint's
records allocates tens of thousands of objects at once, which sets off passes in the
middle of the phase a controller is timing. `collector_paused()` holds the collector
off for such a phase: what it allocates is either freed by reference counting (the
exported records, once encoded) or kept (installed sessions), and a later pass runs as
usual once the phase is over. The proxy holds it off while it reads, places and sends a
restore's records: parsing 16 MB of them set off a full pass of about 0.2 s, half of the
16,000-rollout restore (bench/HISTORY.md, 2026-12-03). A collector the app turned off
stays off. Phases nest (a counter), on one thread: the event loop's.

`freeze_startup_heap()` takes what a process built before serving (the modules it
imported, the app) out of every later pass: a NeMo Gym server's imports leave about
200,000 objects the collector tracks, which a full pass walks in about 150 ms, with the
event loop stopped (`bench/gc_pause.py`). They live as long as the process, so no pass
could free them; what the process allocates from then on is collected as before.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused", "freeze_startup_heap"]

_depth = 0  # phases running now (the channel may handle two at once)
_resume = False  # whether the collector was on when the first of them began


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    global _depth, _resume
    if _depth == 0:
        _resume = gc.isenabled()
        gc.disable()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _resume:
            gc.enable()


def freeze_startup_heap() -> None:
    """Collect what the start-up left behind once, then move every object still
    tracked to the collector's permanent generation (`gc.freeze`). A process that forks
    workers (the zygote) calls it before forking, so their passes never touch, and
    copy, the pages they share with it."""
    gc.collect()
    gc.freeze()
