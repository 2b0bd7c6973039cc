"""Event-loop lag: how late a timer fires, sampled by a task of the loop itself.

A loop busy with a long callback (a blocking call in an app, a huge JSON body) runs its
timers late; the lag is how late. The proxy and every worker run one `LoopLag`, and
/metrics shows each one's (gym-proxy's and NeMo Gym's users ask for it: Gym#3156).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["LoopLag"]

# Seconds between samples. A stall shows as its length less the time the timer had
# already waited when it began: at most one interval under the stall, so that a loop
# blocked 1 s at a time, back to back, shows 0.9 s (it showed 0.5 s at 0.5). Ten
# wake-ups a second cost a loop nothing measurable.
INTERVAL = 0.1


class LoopLag:
    """The latest lag and, for each reader, the worst one since that reader's last
    `take_worst` (a scrape and the supervisor's pings each see every stall)."""

    def __init__(self, readers: tuple[str, ...] = ("scrape",)) -> None:
        self.last = 0.0
        self._worst = dict.fromkeys(readers, 0.0)
        self._task: asyncio.Task[None] | None = None
        # Told (when the sample was due, when it was taken) at every sample: a worker
        # charges the lateness to the requests it held then (`worker.session_load`).
        self.on_sample: Callable[[float, float], None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._sample())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def take_worst(self, reader: str = "scrape") -> float:
        """The worst lag since `reader`'s last call (it sees every stall between two)."""
        worst = max(self._worst[reader], self.last)
        self._worst[reader] = 0.0
        return worst

    async def _sample(self) -> None:
        while True:
            due = time.monotonic() + INTERVAL
            await asyncio.sleep(INTERVAL)
            now = time.monotonic()
            self.last = lag = max(0.0, now - due)
            for reader, worst in self._worst.items():
                self._worst[reader] = max(worst, lag)
            if self.on_sample is not None:
                self.on_sample(due, now)
