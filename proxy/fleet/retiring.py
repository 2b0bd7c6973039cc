"""Emptying a worker and stopping it: the retire step that a rolling restart, a shrink
and a recycle share, and the emptying a drain does (`proxy.fleet.operations`).

- **empty**: take the worker out of new sessions; move its sessions to its heirs and
  hand its running `/run` episodes over (`proxy.fleet.handovers`), side by side, until
  none is left or the deadline;
- **take out**: hold every request still routed to it at the proxy, wait for its running
  requests (handing over the episodes among them), move what they left, and send
  whatever still names its owner to an heir (`Router.retire_owner`);
- **retire later**: a worker that could not be emptied keeps serving what it holds and
  is retired in the background. Each attempt takes the checkpoint exclusion only when it
  can succeed: none of its requests running but episodes that parked (outside the
  exclusion, where a parked episode changes nothing a checkpoint would see), and nothing
  left that cannot move.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from gym_proxy.coordinator.contract.channel import ChannelClosed, ChannelTimeout, RemoteError
from gym_proxy.coordinator.contract.messages import ListHeld, ParkEpisodes, ResumeEpisodes
from gym_proxy.proxy.fleet.handovers import hand_over
from gym_proxy.proxy.fleet.mover import Checkpoints, Moved, Mover, failures, is_free

__all__ = ["Retirer", "WorkerPool", "Progress"]

log = logging.getLogger("gym_proxy.operations")

POLL = 0.05  # seconds between looks at a worker being emptied
FINAL_SWEEP = 5.0  # seconds the last step of a retire gets even past the timeout
RETRY_RETIRE = 1.0  # seconds between background attempts at a worker left serving
PARK_AHEAD = 30.0  # seconds a left-serving worker's episodes get to reach a boundary


class WorkerPool(Protocol):
    """What operations need from the supervisor."""

    slots: list[Any]
    config: Any

    def current(self, slot_index: int) -> Any: ...

    def workers(self) -> Sequence[Any]: ...

    async def start_successor(self, slot_index: int, within: float) -> Any: ...

    async def add_slot(self, within: float) -> Any: ...

    def promote(self, successor: Any) -> Any: ...

    def remove_last_slot(self) -> Any: ...

    def take_out_of_service(self, worker: Any) -> None: ...

    async def stop_worker(self, worker: Any, grace: float) -> int | None: ...

    def hold_worker(self, worker: Any) -> None: ...

    def release_worker(self, worker: Any) -> None: ...

    def retire_owner(self, old: str, heir: str) -> None: ...


@dataclass
class Progress:
    """One operation, as `status` shows it while it runs and after."""

    operation: str
    reason: str
    started_at: float  # Unix seconds
    step: str = "starting"
    moved: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    episodes_moved: int = 0  # running /run episodes handed over (proxy.fleet.handovers)
    episodes_failed: dict[str, str] = field(default_factory=dict)
    episodes_to: dict[str, str] = field(default_factory=dict)  # episode key -> its owner now
    slots: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float | None = None  # set when it ended

    def view(self, waiting: int) -> dict[str, Any]:
        view = asdict(self)
        view["failed"] = failures(self.failed)
        view["episodes_failed"] = [
            {"episode": key, "reason": why} for key, why in sorted(self.episodes_failed.items())
        ]
        view["episodes_handed_over"] = [
            {"episode": key, "owner": owner}
            for key, owner in sorted(view.pop("episodes_to").items())
        ]
        view["waiting"] = waiting
        return view


@dataclass(eq=False)
class Retirer:
    """The steps of the module docstring, for the operations that own the exclusion."""

    pool: WorkerPool
    mover: Mover
    checkpoints: Checkpoints
    # The operations' own: an exclusive operation of a kind, for a reason, and its progress.
    exclusive: Callable[[str, str], AbstractAsyncContextManager[Progress]]
    in_background: Callable[[Any], None]

    async def retire(
        self,
        worker: Any,
        heirs: Callable[[], list[Any]],
        within: float,
        progress: Progress,
        entry: dict[str, Any],
    ) -> None:
        """Empty `worker` into `heirs` and stop it (module docstring); one that cannot be
        emptied in `within` seconds keeps serving and is retired in the background."""
        deadline = time.monotonic() + within
        left = await self.empty(worker, heirs, deadline, progress)
        if left == [] and await self._take_out(worker, heirs, deadline, progress):
            entry["outcome"] = "stopped"
            await self.pool.stop_worker(worker, float(self.pool.config.graceful_timeout))
            return
        if worker.state == "dead":
            entry["outcome"] = "died while it was emptied"
            return
        listing = await self.listing(worker)
        kept = [] if listing is None else list(listing.session_ids)
        running = [] if listing is None else [e.key for e in listing.episodes]
        entry["outcome"] = "left serving what it holds; retired when it can be"
        entry["sessions_left"] = len(kept)
        entry["episodes_left"] = len(running)
        what = f"slot {worker.slot}: the old worker (pid {worker.pid}) keeps"
        if kept or not running:
            progress.errors.append(f"{what} {len(kept)} sessions {self.why_left(kept, progress)}")
        if running:
            reasons = sorted({progress.episodes_failed.get(k, "it runs on") for k in running})
            progress.errors.append(f"{what} {len(running)} running episodes ({'; '.join(reasons)})")
        self.in_background(self._retire_later(worker, heirs))

    async def empty(
        self,
        worker: Any,
        heirs: Callable[[], list[Any]],
        deadline: float,
        progress: Progress,
    ) -> list[str] | None:
        """Take `worker` out of new sessions and move its sessions to `heirs` until none
        is left or `deadline`; answer the sessions it still holds (None: it did not say,
        so it is not empty as far as anyone knows)."""
        worker.route.draining = True
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
            targets = [h for h in heirs() if h is not worker]
            if not listing.movable or not targets:
                await asyncio.sleep(POLL)  # restart-only: its sessions end where they are
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
                await asyncio.sleep(POLL)
        return []

    async def _hand_over(
        self,
        worker: Any,
        episodes: list[Any],
        targets: list[Any],
        deadline: float,
        progress: Progress,
    ) -> int:
        """Hand `worker`'s running episodes over to `targets`; answer how many went."""
        if not episodes or not targets:
            return 0
        result = Moved()
        step = progress.step
        progress.step = f"slot {worker.slot}: handing over {len(episodes)} running episodes"
        await hand_over(self.mover, worker, episodes, targets, deadline, result)
        progress.step = step
        progress.episodes_moved += len(result.moved)
        progress.episodes_to.update(result.moved)
        for key in result.moved:
            progress.episodes_failed.pop(key, None)
        progress.episodes_failed.update(result.failed)
        return len(result.moved)

    async def _take_out(
        self,
        worker: Any,
        heirs: Callable[[], list[Any]],
        deadline: float,
        progress: Progress,
    ) -> bool:
        """The last step of a retire: with every request for `worker` held at the proxy,
        wait for its running ones, move what they left, and send what still names its
        owner to an heir. False (nothing changed, it serves on) when it is not empty."""
        final = max(deadline, time.monotonic() + FINAL_SWEEP)
        self.pool.hold_worker(worker)
        try:
            while True:
                if not worker.route.in_flight:
                    if await self.empty(worker, heirs, final, progress) != []:
                        return False
                    listing = await self.listing(worker)
                    if listing is None or listing.session_ids:
                        return False
                    if not listing.requests:  # a request its client left may still run
                        break
                if time.monotonic() >= final or worker.state != "live":
                    return False
                if not await self._hand_over_running(worker, heirs, final, progress):
                    await asyncio.sleep(POLL)
            targets = [h for h in heirs() if h is not worker]
            if not targets:
                return False
            heir = min(targets, key=lambda h: h.route.in_flight)
            self.pool.retire_owner(worker.owner, heir.owner)
            self.pool.take_out_of_service(worker)
            return True
        finally:
            self.pool.release_worker(worker)

    async def _hand_over_running(
        self, worker: Any, heirs: Callable[[], list[Any]], deadline: float, progress: Progress
    ) -> int:
        """With `worker`'s requests held, hand over the episodes it still runs."""
        listing = await self.listing(worker)
        if listing is None:
            return 0
        episodes = self._movable(listing.episodes, progress)
        targets = [h for h in heirs() if h is not worker]
        return await self._hand_over(worker, episodes, targets, deadline, progress)

    @staticmethod
    def _movable(episodes: list[Any], progress: Progress) -> list[Any]:
        """The episodes a hand-over may move; each other one is reported with why not."""
        for episode in episodes:
            if episode.unmovable:
                progress.episodes_failed[episode.key] = episode.unmovable
        return [e for e in episodes if not e.unmovable]

    async def _retire_later(self, worker: Any, heirs: Callable[[], list[Any]]) -> None:
        """Retire a worker left serving, as soon as its sessions let it."""
        while worker.state == "live":
            await asyncio.sleep(RETRY_RETIRE)
            if not is_free(self.checkpoints):
                continue
            # Only an attempt that can succeed takes the exclusion (checkpoints get 409
            # meanwhile): none of its requests running, and nothing left that cannot move.
            listing = await self.listing(worker)
            if listing is None or (listing.session_ids and not listing.movable):
                continue
            # Running requests keep it, unless each is an episode it can hand over; those
            # park at their boundary first, so the exclusion is taken only once they did.
            movable = [e.key for e in listing.episodes if not e.unmovable]
            if worker.route.in_flight > len(movable) or listing.requests > len(movable):
                continue
            if movable and not await self._park_ahead(worker, movable):
                continue
            if not is_free(self.checkpoints):
                continue  # one began while it listed
            async with self.exclusive("worker_retire", f"worker {worker.slot} left serving") as p:
                entry: dict[str, Any] = {"slot": worker.slot, "owner": worker.owner}
                p.slots.append(entry)
                deadline = time.monotonic() + RETRY_RETIRE
                if await self.empty(worker, heirs, deadline, p) == [] and await self._take_out(
                    worker, heirs, deadline, p
                ):
                    entry["outcome"] = "stopped"
                    await self.pool.stop_worker(worker, float(self.pool.config.graceful_timeout))
                    return

    async def _park_ahead(self, worker: Any, keys: list[str]) -> bool:
        """Park `worker`'s episodes at their next boundary (up to PARK_AHEAD seconds),
        outside the exclusion: parked, an episode changes nothing a checkpoint would see.
        True when all parked and the server is free; else they go on running."""
        try:
            within = PARK_AHEAD
            parked = await worker.channel.request(ParkEpisodes(keys, within), within=within + 5)
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            log.warning("worker %d did not park its episodes: %s", worker.slot, exc)
            return False
        if not parked.not_parked and is_free(self.checkpoints):
            return True
        with contextlib.suppress(ChannelClosed, ChannelTimeout, RemoteError):
            await worker.channel.request(ResumeEpisodes(keys), within=10.0)
        return False

    async def listing(self, worker: Any) -> Any:
        try:
            return await worker.channel.request(ListHeld(), within=10.0)
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            log.warning("worker %d did not list its sessions: %s", worker.slot, exc)
            return None

    async def held_sessions(self, worker: Any) -> list[str]:
        listing = await self.listing(worker)
        return [] if listing is None else list(listing.session_ids)

    def why_left(self, left: list[str], progress: Progress) -> str:
        reasons = {progress.failed[s] for s in left if s in progress.failed}
        if reasons:
            return "(" + "; ".join(sorted(reasons)) + ")"
        return "(they could not move: a restart-only app's sessions end where they are)"
