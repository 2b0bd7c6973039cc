"""The one exclusion checkpoints and live operations share.

A checkpoint (from its prepare to its resume, or a restore) and a move or live operation
(a drain, resize, restart, recycle, a decommission that finishes late) never overlap: a
checkpoint must see every session where it is, and an operation must not move what a
checkpoint is exporting. Whichever comes second is refused 409 `operation_conflict`,
naming what is in the way; nothing waits, so a controller decides when to retry.

The open checkpoint is the phase machine's (asked, never copied); the running operation
is the one state kept here. What waits for the exclusion to be free (a queued signal's
operation) is woken as it becomes free, by `freed()`: the end of an operation here, a
checkpoint back to idle in the phase machine (`PhaseMachine.on_idle`).

A rebalance (`proxy.fleet.balancer`) holds the exclusion too, but it is gym-proxy's own
choice, not a controller's: it *gives way*. A checkpoint, a restore or an operator's
operation that finds one running waits for it (`give_way`; its moves are bounded by
`GIVE_WAY` seconds) instead of being refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gym_proxy.coordinator.contract.errors import GymError

__all__ = ["Exclusion", "GIVE_WAY"]

GIVE_WAY = 10.0  # seconds at most a checkpoint or an operation waits for a rebalance


@dataclass(eq=False)
class Exclusion:
    open_checkpoint: Callable[[], str | None]  # the checkpoint open now, if one is
    operation: str | None = None  # the move or live operation running, if one is
    yields: bool = False  # the one running gives way (a rebalance)
    _waiting: list[asyncio.Future[None]] = field(default_factory=list)

    def is_free(self) -> bool:
        """No checkpoint open and no move or operation running."""
        return self.operation is None and self.open_checkpoint() is None

    def refuse_operation(self, kind: str) -> None:
        """409 naming what is in the way of an operation of `kind`, if anything is."""
        open_id = self.open_checkpoint()
        if open_id is not None:
            raise GymError(
                "operation_conflict", f"checkpoint {open_id} is open; a {kind} waits for its resume"
            )
        self.refuse_checkpoint()

    def refuse_checkpoint(self) -> None:
        """409 if a move or operation runs (a prepare or a restore would see it half done)."""
        if self.operation is not None:
            raise GymError("operation_conflict", f"a {self.operation} is running; retry after it")

    def in_the_way(self) -> str | None:
        """What holds the exclusion, in words a refusal gives (None when free): a
        take-over waits for it, since the successor would not have its state."""
        open_id = self.open_checkpoint()
        if open_id is not None:
            return f"checkpoint {open_id} is open; take over after its resume"
        if self.operation is not None:
            return f"a {self.operation} is running; take over after it"
        return None

    @contextlib.contextmanager
    def hold(self, kind: str, yields: bool = False) -> Iterator[None]:
        """Run an operation of `kind`, refused (above) unless everything is free;
        `yields`: others wait for it to end rather than being refused (`give_way`)."""
        self.refuse_operation(kind)
        self.operation, self.yields = kind, yields
        try:
            yield
        finally:
            self.operation, self.yields = None, False
            self.freed()

    async def give_way(self) -> None:
        """Wait (GIVE_WAY seconds at most) while an operation that gives way runs, so
        that the caller's refusal check sees it ended."""
        if self.operation is not None and self.yields:
            deadline = time.monotonic() + GIVE_WAY
            while self.operation is not None and self.yields:
                if not await self.until_free(deadline - time.monotonic()):
                    return

    def freed(self) -> None:
        """What held the exclusion ended: wake whatever waits for it (`until_free`)."""
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    async def until_free(self, within: float) -> bool:
        """Wait until nothing holds the exclusion, or `within` seconds; True when free.
        (Free now need not mean free when the caller acts: it takes it with `hold`.)"""
        deadline = time.monotonic() + within
        while not self.is_free():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                pass
            finally:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
        return True
