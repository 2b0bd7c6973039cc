"""`gym-proxy` entry point: hold the operators' signals, then start (`proxy.startup`).

HUP, TTIN and TTOU end a process that has no handler for them, and the server installs
its handlers only once its modules are imported, the flags checked and `APP` imported
(a second or more). `main` blocks them first, before anything slow is imported; one
that arrives meanwhile stays pending, and the server, once its handlers are in place,
logs it as ignored (`proxy.server`). The kernel keeps one pending signal of each kind.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

__all__ = ["main", "OPERATION_SIGNALS", "hold_operation_signals", "release_operation_signals"]

# gunicorn's and uvicorn's: HUP rolling restart, TTIN/TTOU one worker more or less.
OPERATION_SIGNALS = (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)


def hold_operation_signals() -> None:
    """Keep HUP/TTIN/TTOU pending instead of letting their default action end gym-proxy."""
    signal.pthread_sigmask(signal.SIG_BLOCK, OPERATION_SIGNALS)


def release_operation_signals() -> None:
    """Deliver them again (to the handlers, which must be in place by now)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, OPERATION_SIGNALS)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point."""
    hold_operation_signals()
    from gym_proxy.proxy.startup import (
        start,  # aiohttp, uvloop, the server: after the signals are held
    )

    start(argv)
