"""The one exclusion checkpoints and live operations share.

A checkpoint (from its prepare to its resume, or a restore) and a move or live operation
(a drain, resize, restart, recycle, a decommission that finishes late) never overlap: a
checkpoint must see every session where it is, and an operation must not move what a
checkpoint is exporting. Whichever comes second is refused 409 `operation_conflict`,
naming what is in the way; nothing waits, so a controller decides when to retry.

Its two states are the open checkpoint, which the phase machine reports as it opens and
goes back to idle (`checkpoint_opened`, `checkpoint_closed`), and the operation running.
The proxy's assembly makes the one exclusion and hands it to the checkpointer, the
mover, the live operations, the balancer and the take-over. What waits for the exclusion
to be free (a queued signal's operation) is woken as it becomes free, by `freed()`.

Each user takes it in one call that cannot be half done: an operation with `acquire`
(give way, refuse, hold), a prepare or a restore with `admit_checkpoint` (give way,
refuse), a take-over with `blocking_take_over` (give way, then what still holds it).

gym-proxy's own choices hold the exclusion too, but no controller asked for them: a
rebalance (`proxy.fleet.balance.balancer`) and an autoscale resize (`proxy.fleet.balance.autoscale`)
*give way*. A checkpoint, a restore, an operator's operation or a take-over that finds
one running asks it to (`give_way`) and waits for it to end, GIVE_WAY seconds at most,
instead of being refused: the one that yields sees `asked` resolved (its waits end on
it) and `giving_way` true, stops at its next step, and leaves everything as consistent
as before it began (what it moved stays moved, what it had not yet stays; a resize
that gave way keeps the worker count it had), saying that it gave way; gym-proxy tries
again later. What an operator asked for (an operation, or a recycle its
`--max-requests`/`--max-worker-memory` call for) still refuses a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from gym_proxy.coordinator.contract.errors import GymError

__all__ = ["Exclusion", "GIVE_WAY"]

# Seconds at most a checkpoint or an operation waits for one that gives way to end (it
# stops at its next step once asked: a move's batch, a worker's last sweep, a stop).
GIVE_WAY = 10.0


@dataclass(eq=False)
class Exclusion:
    checkpoint: str | None = None  # the checkpoint open now, if one is
    operation: str | None = None  # the move or live operation running, if one is
    yields: bool = False  # the one running gives way (a rebalance, an autoscale resize)
    _waiting: list[asyncio.Future[None]] = field(default_factory=list)
    _asked: asyncio.Future[None] | None = None  # while one that yields runs

    @property
    def asked(self) -> asyncio.Future[None] | None:
        """While an operation that yields runs: resolved when it is asked to give way
        (its waits end on it: `proxy.fleet.moves.session_watch`); None while none runs."""
        return self._asked

    @property
    def giving_way(self) -> bool:
        """The running operation yields and was asked to: it stops at its next step."""
        return self._asked is not None and self._asked.done()

    def open_checkpoint(self) -> str | None:
        """The ID of the checkpoint open now, if one is."""
        return self.checkpoint

    def checkpoint_opened(self, checkpoint_id: str) -> None:
        """The phase machine left idle for `checkpoint_id`."""
        self.checkpoint = checkpoint_id

    def checkpoint_closed(self) -> None:
        """The phase machine is back to idle: whatever waited for it may go."""
        self.checkpoint = None
        self.freed()

    @contextlib.asynccontextmanager
    async def acquire(self, kind: str, yields: bool = False) -> AsyncIterator[None]:
        """Run an operation of `kind` while holding the exclusion: one that gives way is
        asked to first (unless this one `yields` too: gym-proxy's own never pushes
        another aside), then anything still in the way refuses it 409."""
        if not yields:
            await self.give_way()
        with self.hold(kind, yields):
            yield

    async def admit_checkpoint(self) -> None:
        """A prepare or a restore may begin: one that gives way is asked to first, then
        an operation still running refuses it 409."""
        await self.give_way()
        self.refuse_checkpoint()

    async def blocking_take_over(self) -> str | None:
        """What keeps a take-over from happening once whatever gives way has (None when
        nothing does), in the words of its refusal."""
        await self.give_way()
        return self.in_the_way()

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
        `yields`: gym-proxy's own, it gives way to others rather than refuse them
        (`give_way`)."""
        self.refuse_operation(kind)
        self.operation, self.yields = kind, yields
        if yields:
            self._asked = asyncio.get_running_loop().create_future()
        try:
            yield
        finally:
            asked, self._asked = self._asked, None
            if asked is not None and not asked.done():
                asked.cancel()
            self.operation, self.yields = None, False
            self.freed()

    async def give_way(self) -> None:
        """Ask an operation that yields to give way, and wait until it ended (GIVE_WAY
        seconds at most), so that the caller's refusal check sees it gone. One that
        yields and begins meanwhile is asked in turn."""
        deadline = time.monotonic() + GIVE_WAY
        while self.operation is not None and self.yields:
            if self._asked is not None and not self._asked.done():
                self._asked.set_result(None)
            if not await self._freed_within(deadline - time.monotonic()):
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
            if not await self._freed_within(deadline - time.monotonic()):
                return False
        return True

    async def _freed_within(self, within: float) -> bool:
        """Until what holds the exclusion lets go of it (`freed`), or `within` seconds;
        True when it did (something else may hold it again by now)."""
        if within <= 0:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await asyncio.wait_for(waiter, within)
        except TimeoutError:
            return False
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
        return True
