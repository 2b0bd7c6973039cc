"""The exit codes a worker process reports to the supervisor that started it, and how
gym-proxy's processes exit."""

from __future__ import annotations

import gc
import sys
from typing import Final, NoReturn

__all__ = ["BOOT_ERROR", "LOST_COORDINATOR", "USAGE_ERROR", "exit_process"]

# gym-proxy's: its command line cannot be served as given (a bad flag, a port in use).
USAGE_ERROR: Final = 2
# The app cannot be built or started: respawning would fail the same way, so the
# supervisor stops the whole server instead.
BOOT_ERROR: Final = 3
# The coordinator channel ended (the proxy is gone or stopping): respawned if wanted.
LOST_COORDINATOR: Final = 4


def exit_process(code: int) -> NoReturn:
    """Exit with `code` once the process's own shutdown is done, without the final
    garbage collections of the interpreter's teardown: they walk every object the app
    imported (a NeMo Gym server: about 240,000) several times, which took 2-5 s per
    process on a busy machine, after the app had finished. Frozen objects are skipped;
    atexit handlers, thread joins and stream flushes still run."""
    gc.freeze()
    sys.exit(code)
