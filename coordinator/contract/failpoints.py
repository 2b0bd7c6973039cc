"""Named crash points for tests of crash safety (`GYM_PROXY_FAILPOINTS=name,...`).

A test that must show what a crash at an exact point leaves behind sets the variable;
the process then exits at once, like `kill -9`, with status 97. Unset, `hit` costs one
dictionary lookup and does nothing.
"""

from __future__ import annotations

import os

__all__ = ["hit", "FAILPOINT_EXIT"]

FAILPOINT_EXIT = 97
_ACTIVE = frozenset(filter(None, os.environ.get("GYM_PROXY_FAILPOINTS", "").split(",")))


def hit(name: str) -> None:
    """Exit immediately if the failpoint `name` is active."""
    if name in _ACTIVE:
        os._exit(FAILPOINT_EXIT)
