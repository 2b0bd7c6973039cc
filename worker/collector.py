"""Bulk record work without the cyclic garbage collector's passes over the heap.

A worker that holds thousands of sessions has a large heap, and CPython's collector
walks all of it in a full (generation 2) pass: 0.4-1.7 s each in the scale bench's
workers (bench/HISTORY.md, 2026-12-02 17:05). Exporting or installing a checkpoint's
records allocates tens of thousands of objects at once, which sets off passes in the
middle of the phase a controller is timing. `collector_paused()` holds the collector
off for such a phase: what it allocates is either freed by reference counting (the
exported records, once encoded) or kept (installed sessions), and a later pass runs as
usual once the phase is over. A collector the app turned off stays off.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]

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
