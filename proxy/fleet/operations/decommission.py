"""Decommissioning a worker, emptying it and stopping it: the step that a rolling restart, a shrink
and a recycle share, and the emptying a drain does (`proxy.fleet.operations.live`).

- **empty**: take the worker out of new sessions; move its sessions to its heirs and
  hand its running `/run` episodes over (`proxy.fleet.moves.handovers`), side by side, until
  none is left or the deadline;
- **take out**: hold every request still routed to it at the proxy, wait for its running
  requests (handing over the episodes among them), move what they left, and send
  whatever still names its owner to an heir (`Router.inherit_owner`);
- **take out or keep** (gym-proxy's own shrink, which gives way: `coordinator.exclusion`):
  empty it and take it out while it still has its slot; when that cannot be done in
  time, or it is asked to give way, it takes sessions again as before (what moved stays
  moved) and keeps its slot;
- **decommission later**: a worker that could not be emptied keeps serving what it holds and
  is decommissioned in the background. Each attempt takes the checkpoint exclusion only when it
  can succeed: none of its requests running but episodes that parked (outside the
  exclusion, where a parked episode changes nothing a checkpoint would see), and nothing
  left that cannot move.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from gym_proxy.coordinator.contract.answers import (
    EpisodeHandedOver,
    EpisodeNotHandedOver,
    OperationReport,
    SlotOutcome,
)
from gym_proxy.coordinator.contract.channel import ChannelClosed, ChannelTimeout, RemoteError
from gym_proxy.coordinator.contract.messages import (
    HeldSessions,
    ListHeld,
    ParkEpisodes,
    ResumeEpisodes,
    RunningEpisode,
)
from gym_proxy.coordinator.exclusion import GIVE_WAY, Exclusion
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.fleet.moves.handovers import hand_over
from gym_proxy.proxy.fleet.moves.mover import Moved, Mover, failures
from gym_proxy.proxy.fleet.moves.session_watch import worker_watch
from gym_proxy.proxy.fleet.supervision.intent import KeptIntent
from gym_proxy.proxy.fleet.supervision.slots import Slots
from gym_proxy.proxy.fleet.supervision.worker_records import WorkerProcess

__all__ = ["Decommissioner", "WorkerPool", "Progress", "SlotEntry", "Step"]

log = logging.getLogger("gym_proxy.operations")

# A worker being emptied is looked at again as one of its requests ends (a move's sessions
# free, a session ended, an episode at its end), or after this many seconds at the most:
# what no request of its own changes (a session's idle end, an heir registering).
LOOK_AGAIN = 0.2
FINAL_SWEEP = 5.0  # seconds the last step of a decommission gets even past the timeout
RETRY_DECOMMISSION = 1.0  # seconds between background attempts at a worker left serving
PARK_AHEAD = 30.0  # seconds a left-serving worker's episodes get to reach a boundary
# Seconds an operation that gives way lets episodes take to park, each try: a park is
# the worker's wait, which no ask to give way ends, so it stays within GIVE_WAY.
PARK_WHILE_YIELDING = GIVE_WAY / 2


class WorkerPool(Protocol):
    """What operations need from the supervisor
    (`proxy.fleet.supervision.supervisor.Supervisor`)."""

    slots: Slots
    config: Config
    intent: KeptIntent

    async def start_successor(self, slot_index: int, within: float) -> WorkerProcess: ...

    async def add_slot(self, within: float) -> WorkerProcess: ...

    def remove_last_slot(self) -> WorkerProcess | None: ...

    def take_out_of_service(self, worker: WorkerProcess) -> None: ...

    async def stop_worker(self, worker: WorkerProcess, grace: float) -> int | None: ...


# What an operation is doing now (`Progress.step`; `detail` says it in words, with its
# numbers). A controller or a test acts on the step, never on the words.
Step = Literal[
    "starting",
    "starting_worker",  # a resize adds a slot: its worker boots
    "starting_replacement",  # a restart: the slot's new worker boots
    "moving_sessions",  # to the replacement, or to the other workers (a drain)
    "handing_over",  # running /run episodes go to the workers taking over
    "pausing",  # a restart's pause between slots
    "removing_slot",  # a shrink
    "done",
]


@dataclass
class Progress:
    """One operation, as `status` shows it while it runs and after."""

    operation: str
    reason: str
    started_at: float  # Unix seconds
    step: Step = "starting"
    detail: str = ""  # the step in words
    step_slot: int | None = None  # the slot the step is about, if one
    moved: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    episodes_moved: int = 0  # running /run episodes handed over (proxy.fleet.moves.handovers)
    episodes_failed: dict[str, str] = field(default_factory=dict)
    episodes_to: dict[str, str] = field(default_factory=dict)  # episode key -> its owner now
    slots: list[SlotEntry] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float | None = None  # set when it ended

    def at(self, step: Step, slot: int | None, detail: str) -> None:
        self.step, self.step_slot, self.detail = step, slot, detail

    def slot(self, slot: int, **said: Any) -> SlotEntry:
        """A slot this operation acts on, with what it says of it so far."""
        entry = SlotEntry(SlotOutcome(slot, **said))
        self.slots.append(entry)
        return entry

    def view(self, waiting: int, **ended: Any) -> OperationReport:
        """As `status` shows it (`waiting`: sessions whose requests wait at the proxy);
        `ended`: what its call's answer says once it ended."""
        said: dict[str, Any] = dict(
            operation=self.operation,
            reason=self.reason,
            started_at=self.started_at,
            step=self.step,
            detail=self.detail,
            step_slot=self.step_slot,
            moved=self.moved,
            failed=failures(self.failed),
            episodes_moved=self.episodes_moved,
            episodes_failed=[
                EpisodeNotHandedOver(key, why) for key, why in sorted(self.episodes_failed.items())
            ],
            episodes_handed_over=[
                EpisodeHandedOver(key, owner) for key, owner in sorted(self.episodes_to.items())
            ],
            slots=[entry.outcome for entry in self.slots],
            errors=list(self.errors),
            seconds=self.seconds,
            waiting=waiting,
        )
        if "complete" in ended:  # its call's answer: it has ended, whatever step it was at
            said.update(step="done", detail="", step_slot=None)
        return OperationReport(**(said | ended))


@dataclass(eq=False)
class SlotEntry:
    """What an operation did to one slot, said as it goes (`status` shows it meanwhile)."""

    outcome: SlotOutcome

    def note(self, **said: Any) -> None:
        self.outcome = replace(self.outcome, **said)


@dataclass(eq=False)
class Decommissioner:
    """The steps of the module docstring, for the operations that own the exclusion."""

    pool: WorkerPool
    mover: Mover
    exclusion: Exclusion
    # The operations' own: an exclusive operation of a kind, for a reason, and its progress.
    exclusive: Callable[[str, str], AbstractAsyncContextManager[Progress]]
    in_background: Callable[[Coroutine[Any, Any, None]], None]

    async def decommission(
        self,
        worker: WorkerProcess,
        heirs: Callable[[], list[WorkerProcess]],
        within: float,
        progress: Progress,
        entry: SlotEntry,
    ) -> None:
        """Empty `worker` into `heirs` and stop it (module docstring); one that cannot be
        emptied in `within` seconds keeps serving and is decommissioned in the background."""
        deadline = time.monotonic() + within
        left = await self.empty(worker, heirs, deadline, progress)
        if left == [] and await self._take_out(worker, heirs, deadline, progress):
            entry.note(outcome="stopped")
            await self.pool.stop_worker(worker, float(self.pool.config.graceful_timeout))
            return
        if worker.state == "dead":
            entry.note(outcome="died while it was emptied")
            return
        listing = await self.listing(worker)
        kept = [] if listing is None else list(listing.session_ids)
        running = [] if listing is None else [e.key for e in listing.episodes]
        entry.note(
            outcome="left serving what it holds; decommissioned when it can be",
            sessions_left=len(kept),
            episodes_left=len(running),
        )
        what = f"slot {worker.slot}: the old worker (pid {worker.pid}) keeps"
        if kept or not running:
            progress.errors.append(f"{what} {len(kept)} sessions {self.why_left(kept, progress)}")
        if running:
            reasons = sorted({progress.episodes_failed.get(k, "it runs on") for k in running})
            progress.errors.append(f"{what} {len(running)} running episodes ({'; '.join(reasons)})")
        self.in_background(self._decommission_later(worker, heirs))

    async def take_out_or_keep(
        self,
        worker: WorkerProcess,
        heirs: Callable[[], list[WorkerProcess]],
        deadline: float,
        progress: Progress,
    ) -> bool:
        """gym-proxy's own shrink: empty `worker` into `heirs` and take it out while it
        keeps its slot, True once done (the caller removes the slot and stops it); else,
        by `deadline` or once asked to give way, it takes new sessions again (unless an
        operator drained it) and False."""
        left = await self.empty(worker, heirs, deadline, progress)
        if left == [] and not self.exclusion.giving_way:
            if await self._take_out(worker, heirs, deadline, progress):
                return True
        if worker.state == "live":
            worker.live_route.draining = worker.owner in self.pool.intent.drained
        return False

    async def empty(
        self,
        worker: WorkerProcess,
        heirs: Callable[[], list[WorkerProcess]],
        deadline: float,
        progress: Progress,
    ) -> list[str] | None:
        """Take `worker` out of new sessions and move its sessions to `heirs` until none
        is left or `deadline`; answer the sessions it still holds (None: it did not say,
        so it is not empty as far as anyone knows)."""
        worker.live_route.draining = True
        moved: set[str] = set()
        while worker.state == "live":
            await self.mover.drops_done()  # a moved session must not be listed again
            listing = await self.listing(worker)
            if listing is None:
                return None
            episodes = self._movable(listing.episodes, progress)
            # A session an episode carries moves with it (a hand-over), not on its own.
            riding = {s for e in episodes for s in e.sessions}
            todo = [s for s in listing.session_ids if s not in moved]
            alone = [s for s in todo if s not in riding]
            if not todo and not episodes or time.monotonic() >= deadline:
                return todo
            if self.exclusion.giving_way:
                return todo or None  # not empty as far as anyone knows
            targets = [h for h in heirs() if h is not worker]
            if not listing.movable or not targets:
                # Restart-only: its sessions end where they are, by their requests.
                await self._until_a_request_ends(worker, deadline, LOOK_AGAIN)
                continue
            plan: dict[str, list[str]] = {}
            for i, session_id in enumerate(alone):
                plan.setdefault(targets[i % len(targets)].owner, []).append(session_id)
            # Side by side: a session's long request does not hold up an episode, nor back.
            result, handed = await asyncio.gather(
                self.mover.move_sessions(plan, [worker], deadline),
                self._hand_over(worker, episodes, targets, deadline, progress),
            )
            moved.update(result.moved)
            progress.moved += len(result.moved)
            for session_id in result.moved:
                progress.failed.pop(session_id, None)
            progress.failed.update(result.failed)
            if not result.moved and not handed:
                await self._until_a_request_ends(worker, deadline, LOOK_AGAIN)
        return []

    async def _hand_over(
        self,
        worker: WorkerProcess,
        episodes: list[RunningEpisode],
        targets: list[WorkerProcess],
        deadline: float,
        progress: Progress,
    ) -> int:
        """Hand `worker`'s running episodes over to `targets`; answer how many went."""
        if not episodes or not targets:
            return 0
        if self.exclusion.yields:
            deadline = min(deadline, time.monotonic() + PARK_WHILE_YIELDING)
        result = Moved()
        was = (progress.step, progress.step_slot, progress.detail)
        detail = f"slot {worker.slot}: handing over {len(episodes)} running episodes"
        progress.at("handing_over", worker.slot, detail)
        await hand_over(self.mover, worker, episodes, targets, deadline, result)
        progress.at(*was)
        progress.episodes_moved += len(result.moved)
        progress.episodes_to.update(result.moved)
        for key in result.moved:
            progress.episodes_failed.pop(key, None)
        progress.episodes_failed.update(result.failed)
        return len(result.moved)

    async def _take_out(
        self,
        worker: WorkerProcess,
        heirs: Callable[[], list[WorkerProcess]],
        deadline: float,
        progress: Progress,
    ) -> bool:
        """The last step of a decommission: with every request for `worker` held at the proxy,
        wait for its running ones, move what they left, and send what still names its
        owner to an heir. False (nothing changed, it serves on) when it is not empty."""
        final = max(deadline, time.monotonic() + FINAL_SWEEP)
        table = self.mover.table
        table.hold_worker(worker.live_route)
        try:
            while True:
                if not worker.live_route.in_flight:
                    if await self.empty(worker, heirs, final, progress) != []:
                        return False
                    listing = await self.listing(worker)
                    if listing is None or listing.session_ids:
                        return False
                    if not listing.requests:  # a request its client left may still run
                        break
                if time.monotonic() >= final or worker.state != "live" or self.exclusion.giving_way:
                    return False
                if not await self._hand_over_running(worker, heirs, final, progress):
                    await self._until_a_request_ends(worker, final, LOOK_AGAIN)
            targets = [h for h in heirs() if h is not worker]
            if not targets:
                return False
            heir = min(targets, key=lambda h: h.live_route.in_flight)
            table.router.inherit_owner(worker.owner, heir.owner)
            self.pool.take_out_of_service(worker)
            return True
        finally:
            table.release_worker(worker.live_route)

    async def _hand_over_running(
        self,
        worker: WorkerProcess,
        heirs: Callable[[], list[WorkerProcess]],
        deadline: float,
        progress: Progress,
    ) -> int:
        """With `worker`'s requests held, hand over the episodes it still runs."""
        listing = await self.listing(worker)
        if listing is None:
            return 0
        episodes = self._movable(listing.episodes, progress)
        targets = [h for h in heirs() if h is not worker]
        return await self._hand_over(worker, episodes, targets, deadline, progress)

    @staticmethod
    def _movable(episodes: list[RunningEpisode], progress: Progress) -> list[RunningEpisode]:
        """The episodes a hand-over may move; each other one is reported with why not."""
        for episode in episodes:
            if episode.unmovable:
                progress.episodes_failed[episode.key] = episode.unmovable
        return [e for e in episodes if not e.unmovable]

    async def _decommission_later(
        self, worker: WorkerProcess, heirs: Callable[[], list[WorkerProcess]]
    ) -> None:
        """Decommission a worker left serving, as soon as its sessions let it."""
        while worker.state == "live":
            await self._until_a_request_ends(worker, math.inf, RETRY_DECOMMISSION)
            if not self.exclusion.is_free():
                continue
            # Only an attempt that can succeed takes the exclusion (checkpoints get 409
            # meanwhile): none of its requests running, and nothing left that cannot move.
            listing = await self.listing(worker)
            if listing is None or (listing.session_ids and not listing.movable):
                continue
            # Running requests keep it, unless each is an episode it can hand over; those
            # park at their boundary first, so the exclusion is taken only once they did.
            movable = [e.key for e in listing.episodes if not e.unmovable]
            if worker.live_route.in_flight > len(movable) or listing.requests > len(movable):
                continue
            if movable and not await self._park_ahead(worker, movable):
                continue
            if not self.exclusion.is_free():
                continue  # one began while it listed
            async with self.exclusive("decommission", f"worker {worker.slot} left serving") as p:
                entry = p.slot(worker.slot, owner=worker.owner)
                deadline = time.monotonic() + RETRY_DECOMMISSION
                if await self.empty(worker, heirs, deadline, p) == [] and await self._take_out(
                    worker, heirs, deadline, p
                ):
                    entry.note(outcome="stopped")
                    await self.pool.stop_worker(worker, float(self.pool.config.graceful_timeout))
                    return

    async def _park_ahead(self, worker: WorkerProcess, keys: list[str]) -> bool:
        """Park `worker`'s episodes at their next boundary (up to PARK_AHEAD seconds),
        outside the exclusion: parked, an episode changes nothing a checkpoint would see.
        True when all parked and the server is free; else they go on running."""
        try:
            within = PARK_AHEAD
            parked = await worker.live_channel.request(
                ParkEpisodes(keys, within), within=within + 5
            )
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            log.warning("worker %d did not park its episodes: %s", worker.slot, exc)
            return False
        if not parked.not_parked and self.exclusion.is_free():
            return True
        with contextlib.suppress(ChannelClosed, ChannelTimeout, RemoteError):
            await worker.live_channel.request(ResumeEpisodes(keys), within=10.0)
        return False

    async def _until_a_request_ends(
        self, worker: WorkerProcess, deadline: float, at_most: float
    ) -> None:
        """Until a request of `worker` ends, `deadline` or `at_most` seconds from now."""
        until = min(deadline, time.monotonic() + at_most)
        keys = [worker_watch(worker.owner)]
        await self.mover.table.until_a_request_ends(keys, until, self.exclusion.asked)

    async def listing(self, worker: WorkerProcess) -> HeldSessions | None:
        try:
            return await worker.live_channel.request(ListHeld(), within=10.0)
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            log.warning("worker %d did not list its sessions: %s", worker.slot, exc)
            return None

    async def held_sessions(self, worker: WorkerProcess) -> list[str]:
        listing = await self.listing(worker)
        return [] if listing is None else list(listing.session_ids)

    def why_left(self, left: list[str], progress: Progress) -> str:
        reasons = {progress.failed[s] for s in left if s in progress.failed}
        if reasons:
            return "(" + "; ".join(sorted(reasons)) + ")"
        return "(they could not move: a restart-only app's sessions end where they are)"
