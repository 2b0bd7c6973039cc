"""`gym-proxy` entry point: hold the operators' signals, then start (`proxy.startup`).

The signals are held before anything slow is imported (`proxy.signals` says why); this
module imports nothing else at its top for that reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from gym_proxy.proxy.signal_mask import hold_operation_signals

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point."""
    hold_operation_signals()
    from gym_proxy.proxy.startup import (
        start,  # aiohttp, uvloop, the server: after the signals are held
    )

    start(argv)
