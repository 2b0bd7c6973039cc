"""Event-loop lag: how late a timer fires, sampled by a task of the loop itself.

A loop busy with a long callback (a blocking call in an app, a huge JSON body) runs its
timers late; the lag is how late. The proxy and every worker run one `LoopLag`, and
/metrics shows each one's (gym-proxy's and NeMo Gym's users ask for it: Gym#3156).
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["LoopLag"]

INTERVAL = 0.5  # seconds between samples


class LoopLag:
    """The latest lag and the worst one since the last `take_worst`."""

    def __init__(self) -> None:
        self.last = 0.0
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._sample())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def take_worst(self) -> float:
        """The worst lag since the last call (a scrape sees every stall between two)."""
        worst, self.worst = max(self.worst, self.last), 0.0
        return worst

    async def _sample(self) -> None:
        while True:
            due = time.monotonic() + INTERVAL
            await asyncio.sleep(INTERVAL)
            self.last = max(0.0, time.monotonic() - due)
            self.worst = max(self.worst, self.last)
