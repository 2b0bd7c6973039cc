"""Every exit status of gym-proxy's processes (the proxy, a worker, the Ray helpers,
`gym-proxy-ctl`), and how they exit."""

from __future__ import annotations

import gc
import sys
from typing import Final, NoReturn

__all__ = [
    "FAILED",
    "USAGE_ERROR",
    "BOOT_ERROR",
    "LOST_COORDINATOR",
    "RAY_ERROR",
    "EXIT_UNKNOWN",
    "CHECKPOINT_PARTIAL",
    "exit_process",
]

# A helper process (the Ray head holder, the placement driver) could not do its job, or
# a call of gym-proxy-ctl's failed (refused, unreachable, not ready in time): one line
# says why.
FAILED: Final = 1
# A command line that cannot be served as given (a bad flag, a port in use): gym-proxy,
# its helpers, gym-proxy-ctl (argparse's own status).
USAGE_ERROR: Final = 2
# The app cannot be built or started: respawning would fail the same way, so the
# supervisor stops the whole server instead.
BOOT_ERROR: Final = 3
# The coordinator channel ended (the proxy is gone or stopping): respawned if wanted.
LOST_COORDINATOR: Final = 4
# gym-proxy's: the Ray cluster could not be started, joined or used.
RAY_ERROR: Final = 5
# A process whose exit status could not be learned: not this process's child (an adopted
# worker), or one whose Ray actor died with it.
EXIT_UNKNOWN: Final = -1
# gym-proxy-ctl's: the checkpoint was committed but does not hold every rollout in flight
# (coordinator.clients.checkpoint_result): not a failure to retry, and not a complete
# checkpoint either.
CHECKPOINT_PARTIAL: Final = 3


def exit_process(code: int) -> NoReturn:
    """Exit with `code` once the process's own shutdown is done, without the final
    garbage collections of the interpreter's teardown: they walk every object the app
    imported (a NeMo Gym server: about 240,000) several times, which took 2-5 s per
    process on a busy machine, after the app had finished. Frozen objects are skipped;
    atexit handlers, thread joins and stream flushes still run."""
    gc.freeze()
    sys.exit(code)
