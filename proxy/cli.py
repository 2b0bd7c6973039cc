"""`gym-proxy` entry point: hold the operators' signals, read the command line, then
start (`proxy.startup`).

The signals are held before anything slow is imported (`proxy.signals` says why), and
the command line is read before the server is: `--help`, `--version` and a mistake are
answered without importing aiohttp, uvloop or the app. This module imports nothing else
at its top for that reason.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gym_proxy.proxy.signal_mask import hold_operation_signals
from gym_proxy.proxy.usage import usage_error

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point."""
    hold_operation_signals()
    from gym_proxy.proxy.config import ConfigError, config_from_args  # argparse and the options

    try:
        config = config_from_args(argv)
    except ConfigError as exc:
        usage_error(str(exc))
    from gym_proxy.proxy.startup import (
        start,  # aiohttp, uvloop, the server: after the signals are held
    )

    start(config, sys.argv[1:] if argv is None else argv)
