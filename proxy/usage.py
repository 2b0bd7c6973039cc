"""How a mistake in what the user gave is said: one line on stderr, exit status 2
(`coordinator.contract.exit_codes.USAGE_ERROR`), whether the command line or the app,
the port or the runtime directory is at fault."""

from __future__ import annotations

import sys
from typing import NoReturn

from gym_proxy.coordinator.contract.exit_codes import USAGE_ERROR

__all__ = ["usage_error"]


def usage_error(message: str) -> NoReturn:
    """Say `message` in one line and exit with USAGE_ERROR."""
    print(f"gym-proxy: error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)
