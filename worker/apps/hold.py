"""A hold switch for the reference servers: keeps chosen calls waiting while a file
exists, so tests and benches can have rollouts in flight when a checkpoint comes.

`HoldSwitch(file_variable, calls_variable)`: the file is named by the environment
variable `file_variable`; `calls_variable` (optional) names the call numbers held
(`2` = every rollout's second call); without it every call is held. The file is polled
by one task per worker (`watch`), never by the held calls.
"""

from __future__ import annotations

import asyncio
import os

__all__ = ["HoldSwitch"]


class HoldSwitch:
    """On while the hold file exists, for the call numbers it names (or all)."""

    def __init__(self, file_variable: str, calls_variable: str | None = None) -> None:
        self.path = os.environ.get(file_variable)
        listed = os.environ.get(calls_variable, "") if calls_variable else ""
        self.calls = {int(c) for c in listed.split(",") if c.strip()} or None
        self.released = asyncio.Event()
        self.waiting = 0
        self._check()

    def _check(self) -> None:
        if self.path and os.path.exists(self.path):
            self.released.clear()
        else:
            self.released.set()

    async def watch(self) -> None:
        while self.path:
            self._check()
            await asyncio.sleep(0.05)

    async def wait(self, number: int = 0) -> None:
        """Wait while the switch is on, if it holds call `number`."""
        if self.released.is_set() or (self.calls is not None and number not in self.calls):
            return
        self.waiting += 1
        try:
            await self.released.wait()
        finally:
            self.waiting -= 1
