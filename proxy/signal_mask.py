"""The operators' signals held from the process's first line until the server handles
them (`proxy.signals` says why). Imports nothing but `signal`: `proxy.cli` calls
`hold_operation_signals` before anything slow is imported."""

from __future__ import annotations

import signal

__all__ = ["OPERATION_SIGNALS", "hold_operation_signals", "release_operation_signals"]

# gunicorn's and uvicorn's: HUP rolling restart, TTIN/TTOU one worker more or less.
OPERATION_SIGNALS = (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)


def hold_operation_signals() -> None:
    """Keep HUP/TTIN/TTOU pending instead of letting their default action end gym-proxy."""
    signal.pthread_sigmask(signal.SIG_BLOCK, OPERATION_SIGNALS)


def release_operation_signals() -> None:
    """Deliver them again (to the handlers, which must be in place by now)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, OPERATION_SIGNALS)
