"""The signals gym-proxy answers, as gunicorn and uvicorn do: TERM and INT stop it (a
second one skips the drain), HUP restarts the workers one by one, TTIN adds one and
TTOU removes one (`proxy.fleet.operations.live`).

HUP, TTIN and TTOU end a process that has no handler for them, and the server installs
its handlers only once its modules are imported, the flags checked and `APP` imported (a
second or more). `proxy.cli` blocks them first, before anything slow is imported
(`proxy.signal_mask`); one that arrives meanwhile stays pending (the kernel keeps
one of each kind), and is logged as ignored once the handlers are in place, as is any
that comes while the server starts or stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

from gym_proxy.proxy.signal_mask import (
    OPERATION_SIGNALS,
    hold_operation_signals,
    release_operation_signals,
)

__all__ = ["Signals"]

log = logging.getLogger("gym_proxy")


class Signals:
    """The server's handlers. They only set events or hand a name on (STYLE: a handler
    does nothing else); `serving` says whether an operation signal is taken."""

    def __init__(self, on_operation: Callable[[str], None]) -> None:
        self.stop = asyncio.Event()
        self.force = asyncio.Event()  # a second TERM/INT: no more waiting
        self.stopping_since = 0.0  # monotonic time stopping began (a TERM/INT, or another end)
        self.serving = False
        self._on_operation = on_operation

    def install(self) -> None:
        """Handle TERM/INT and the operation signals on the running loop, then deliver
        the operation signals held since the process began."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        for sig in OPERATION_SIGNALS:
            loop.add_signal_handler(sig, self._operation, sig.name.removeprefix("SIG"))
        release_operation_signals()

    def remove(self) -> None:
        """Hold the operation signals again before the loop closes and takes the handlers
        away: until the process exits, a late one stays pending instead of ending it. The
        TERM/INT handlers stay: one that comes while stopping is a second, forcing one."""
        self.serving = False
        hold_operation_signals()
        loop = asyncio.get_running_loop()
        for sig in OPERATION_SIGNALS:
            loop.remove_signal_handler(sig)

    def request_stop(self) -> None:
        """A TERM or INT: stop; a second one forces."""
        if self.stop.is_set():
            self.force.set()
        self.note_stopping()
        self.stop.set()

    def note_stopping(self) -> None:
        """The server stops (for a signal, or another reason): from the first time, the
        final log line counts how long stopping took."""
        self.stopping_since = self.stopping_since or time.monotonic()

    def _operation(self, name: str) -> None:
        if self.serving and not self.stop.is_set():
            self._on_operation(name)
        else:
            log.warning("SIG%s ignored: gym-proxy is not serving (starting or stopping)", name)
