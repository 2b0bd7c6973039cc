"""A process's resident memory, as Linux counts it: read by the proxy for a worker of its
own machine, and by a worker for itself, which it reports in its pongs (a worker Ray
placed on another node has no pid the proxy can read)."""

from __future__ import annotations

import os

__all__ = ["resident_bytes"]

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(pid: int | str = "self") -> int:
    """The process's resident set size (Linux /proc; 0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0
