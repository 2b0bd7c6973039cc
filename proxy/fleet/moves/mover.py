"""Moving live sessions between running workers, with their clients none the wiser.

A move of some sessions to the worker in one slot, in order:

1. hold: a new request of a moving session waits at the proxy, unrouted (so does one of
   a gym-proxy session an app session's requests came under: `links`);
2. wait for the boundary: until none of the session's requests routed before is still
   running (a session whose request outlives the move's timeout is not moved: it is
   reported, and serves where it was). A WebSocket tunnel of the session follows the
   app's `tunnels` choice: closed with 1012 first ("close"), or waited for ("block").
   Each session moves as soon as it reaches its boundary, with the others that did
   (the data path wakes the wait as a request ends: `proxy.fleet.moves.session_watch`, no polling);
3. `move_out` to the source workers (for a move call, every other live worker): the one
   that holds a session answers its record (session store, hooks or a declared session
   dict) and keeps serving it;
4. `move_in` on the target: it installs all the records or none;
5. the proxy's session table sends each moved session to the target (its token and
   cookie do not change: the table wins over the owner a token names);
6. release: the held requests go on, to the target;
7. `drop` on the source: its copy ends (in the background, best effort: it gets no
   request any more). A target that did not take the sessions in time is told to drop
   them too, should it install them late.

A failure before step 5 leaves every session where it was, serving; no session is ever
served by two workers. Moves and checkpoints exclude each other (409
`operation_conflict`), and one move runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gym_proxy.coordinator.broadcast import HasChannel, broadcast, channel_of
from gym_proxy.coordinator.contract import failpoints
from gym_proxy.coordinator.contract.answers import MoveAnswer, NotMoved
from gym_proxy.coordinator.contract.channel import ChannelClosed, ChannelTimeout, RemoteError
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.messages import (
    CloseTunnels,
    Drop,
    LinkedSessions,
    Links,
    MoveIn,
    MoveOut,
    SessionRecords,
)
from gym_proxy.coordinator.exclusion import Exclusion
from gym_proxy.coordinator.readiness import SlotOwner
from gym_proxy.proxy.fleet.moves.move_table import MoveTable

__all__ = ["Mover", "LiveWorkers", "Moved", "failures"]

log = logging.getLogger("gym_proxy.moves")

DROP_WAIT = 30.0  # seconds a worker gets to drop sessions it no longer serves
RUNNING_AT_TIMEOUT = "a request of the session was still running at the timeout"
# A move of gym-proxy's own (a rebalance, an autoscale resize) asked to give way
# (`coordinator.exclusion`) leaves the sessions still waiting for their boundary.
GAVE_WAY = "its move gave way to a checkpoint or an operator's operation"


class _Worker(SlotOwner, HasChannel, Protocol):
    pass


class LiveWorkers(Protocol):
    """The workers a move may take sessions from or give them to (the supervisor)."""

    def live(self) -> Sequence[_Worker]: ...


@dataclass
class Moved:
    """What one batch of moves did: each moved session and the owner it went to, and
    each session not moved with the reason."""

    moved: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False)
class Mover:
    workers: LiveWorkers
    table: MoveTable
    exclusion: Exclusion
    holding: int = 0  # sessions whose new requests wait at the proxy now
    moved_total: int = 0  # sessions moved, and not moved, since start (/metrics)
    failed_total: int = 0
    episodes_moved_total: int = 0  # running episodes handed over, and not (/metrics)
    episodes_failed_total: int = 0
    _drops: set[asyncio.Future[None]] = field(default_factory=set)

    async def move(self, session_ids: list[str], to_slot: int, within: float) -> MoveAnswer:
        """Move `session_ids` to the worker in `to_slot`; answer what moved and what did
        not, and why (module docstring)."""
        async with self.exclusion.acquire("move"):
            target = next((w for w in self.workers.live() if w.slot == to_slot), None)
            if target is None:
                raise GymError("invalid_request", f"no live worker in slot {to_slot}")
            wanted = list(dict.fromkeys(session_ids))
            started = time.monotonic()
            sources = [w for w in self.workers.live() if w.owner != target.owner]
            result = await self.move_sessions({target.owner: wanted}, sources, started + within)
        seconds = round(time.monotonic() - started, 6)
        log.info(
            "moved %d sessions to worker %d in %.3f s (%d not moved)",
            len(result.moved),
            to_slot,
            seconds,
            len(result.failed),
        )
        return MoveAnswer(to_slot, sorted(result.moved), failures(result.failed), seconds)

    async def move_sessions(
        self, plan: dict[str, list[str]], sources: Sequence[_Worker], deadline: float
    ) -> Moved:
        """Move the sessions `plan` lists under each target owner, from whichever of
        `sources` holds them, by the steps of the module docstring. Sessions at their
        boundary move at once, in one batch; each busy one moves as soon as its requests
        end (until `deadline`), so one long request holds up only its own session. The
        caller excludes checkpoints and other moves."""
        target_of = {s: owner for owner, ids in plan.items() for s in ids}
        if not target_of:
            return Moved()
        links = await self.linked_sessions(list(target_of), max(0.1, deadline - time.monotonic()))
        groups = {s: [s, *links.get(s, ())] for s in target_of}
        result = Moved()
        held = {s for group in groups.values() for s in group}
        self.table.hold_sessions(list(held))
        self.holding += len(held)
        await self._close_tunnels(sources, list(held), deadline)
        running = self.table.running_requests
        pending = list(target_of)
        try:
            while pending:
                ready = [s for s in pending if not any(running(x) for x in groups[s])]
                if ready:
                    await self._move(ready, target_of, links, sources, deadline, result)
                    done = [x for s in ready for x in groups[s]]
                    self.table.release_sessions(done)
                    held.difference_update(done)
                    self.holding -= len(done)
                    moved_now = set(ready)
                    pending = [s for s in pending if s not in moved_now]
                if not pending:
                    break
                if time.monotonic() >= deadline or self.exclusion.giving_way:
                    why = GAVE_WAY if self.exclusion.giving_way else RUNNING_AT_TIMEOUT
                    result.failed.update(dict.fromkeys(pending, why))
                    break
                busy = [x for s in pending for x in groups[s] if running(x)]
                await self.table.until_a_request_ends(busy, deadline, self.exclusion.asked)
        finally:
            self.table.release_sessions(list(held))
            self.holding -= len(held)
            self.moved_total += len(result.moved)
            self.failed_total += len(result.failed)
        return result

    async def _close_tunnels(
        self, sources: Sequence[_Worker], session_ids: list[str], deadline: float
    ) -> None:
        """A tunnel of a moving session follows the app's `tunnels` choice: closed now
        (1012: its client reconnects, and waits here), or waited for like a request."""
        within = max(0.1, deadline - time.monotonic())
        for worker, reply in await broadcast(sources, CloseTunnels(session_ids), within):
            if isinstance(reply, BaseException):
                log.warning("worker %d did not close moving tunnels: %s", worker.slot, reply)

    async def linked_sessions(self, wanted: list[str], within: float) -> dict[str, list[str]]:
        """Every worker's gym-proxy sessions that carried these app sessions' requests
        (an app that keeps its own session IDs, as NeMo Gym's servers do: the proxy
        counts a request's running under the gym-proxy session it routed it by)."""
        links: dict[str, list[str]] = {}
        for worker, reply in await broadcast(self.workers.live(), LinkedSessions(wanted), within):
            if isinstance(reply, Links):
                for session_id, linked in reply.links.items():
                    links.setdefault(session_id, []).extend(linked)
            elif isinstance(reply, BaseException):
                log.warning("worker %d did not list linked sessions: %s", worker.slot, reply)
        return links

    async def _move(
        self,
        ready: list[str],
        target_of: dict[str, str],
        links: dict[str, list[str]],
        sources: Sequence[_Worker],
        deadline: float,
        result: Moved,
    ) -> None:
        """Steps 3-7 for sessions at their boundary."""
        failed = result.failed
        within = max(0.1, deadline - time.monotonic())
        found: dict[str, tuple[_Worker, dict[str, Any]]] = {}
        silent = []
        for worker, reply in await broadcast(sources, MoveOut(ready), within):
            if isinstance(reply, SessionRecords):
                for record in reply.records:
                    found[record["session_id"]] = (worker, record)
            elif isinstance(reply, RemoteError):
                silent.append(f"worker {worker.slot} refused: {reply.detail}")
            elif isinstance(reply, ChannelClosed | ChannelTimeout):
                silent.append(f"worker {worker.slot} did not answer: {reply}")
            elif isinstance(reply, BaseException):
                raise reply
        by_target: dict[str, list[dict[str, Any]]] = {}
        for session_id in ready:
            if session_id in found:
                by_target.setdefault(target_of[session_id], []).append(found[session_id][1])
            else:
                why = "; ".join(silent) or "no worker it was asked of holds it"
                failed[session_id] = f"not found on a source worker ({why})"
        failpoints.hit("move-before-install")
        targets = {w.owner: w for w in self.workers.live()}
        installs = []
        for owner, records in by_target.items():
            target = targets.get(owner)
            if target is None:
                for record in records:
                    failed[record["session_id"]] = f"the target worker ({owner}) is gone"
            else:
                installs.append(self._move_in(target, records, deadline, result, links))
        await asyncio.gather(*installs)
        by_source: dict[int, tuple[_Worker, list[str]]] = {}
        for session_id in ready:
            if session_id in result.moved:
                source = found[session_id][0]
                by_source.setdefault(id(source), (source, []))[1].append(session_id)
        for source, ids in by_source.values():
            # It gets none of their requests any more: the held ones need not wait for it.
            self.drop_later(source, ids)

    async def _move_in(
        self,
        target: _Worker,
        records: list[dict[str, Any]],
        deadline: float,
        result: Moved,
        links: dict[str, list[str]],
    ) -> None:
        """`target` takes `records` (all or none); the session table then sends them there."""
        within = max(0.1, deadline - time.monotonic())
        try:
            await channel_of(target).request(MoveIn(records), within=within)
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            for record in records:
                result.failed[record["session_id"]] = f"worker {target.slot} did not take it: {exc}"
            # A target that answers late may still install them: it drops them after
            # (the channel serves its requests in order), so no stray copy stays.
            self.drop_later(target, [r["session_id"] for r in records])
            return
        failpoints.hit("move-installed")
        for record in records:
            session_id = record["session_id"]
            self.table.place_session(session_id, target.owner, kept=True)
            for linked in links.get(session_id, ()):
                self.table.place_session(linked, target.owner, kept=False)
            result.moved[session_id] = target.owner

    def drop_later(
        self, worker: _Worker, session_ids: list[str], episode_keys: Sequence[str] = ()
    ) -> None:
        """Tell `worker`, in the background, to free these sessions (and handed-over
        episodes whose request will not come)."""
        drop = asyncio.ensure_future(self._drop(worker, session_ids, list(episode_keys)))
        self._drops.add(drop)
        drop.add_done_callback(self._drops.discard)

    async def _drop(self, worker: _Worker, session_ids: list[str], episode_keys: list[str]) -> None:
        try:
            await channel_of(worker).request(Drop(session_ids, episode_keys), within=DROP_WAIT)
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            log.warning("worker %d kept %d sessions' state: %s", worker.slot, len(session_ids), exc)

    async def drops_done(self) -> None:
        """Wait for the drops sent so far (an operation stops a worker only after)."""
        if self._drops:
            await asyncio.wait(set(self._drops))


def failures(failed: dict[str, str]) -> list[NotMoved]:
    """Sessions not moved, as the control plane answers them."""
    return [NotMoved(s, r) for s, r in sorted(failed.items())]
