"""Moving live sessions between running workers, with their clients none the wiser.

A move of some sessions to the worker in one slot, in order:

1. hold: a new request of a moving session waits at the proxy, unrouted (so does one of
   a gym-proxy session an app session's requests came under: `links`);
2. wait for the boundary: until none of the session's requests routed before is still
   running (a session whose request outlives the move's timeout is not moved: it is
   reported, and serves where it was);
3. `move_out` to every other live worker: the one that holds a session answers its
   record (session store, hooks or a declared session dict) and keeps serving it;
4. `adopt` on the target: all the records or none;
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

from coordinator.contract.channel import ChannelClosed, ChannelTimeout, RemoteError
from coordinator.contract.errors import GymError
from coordinator.contract.messages import (
    Adopt,
    Drop,
    LinkedSessions,
    Links,
    MoveOut,
    SessionRecords,
)

__all__ = ["Mover", "MoveTable"]

log = logging.getLogger("gym_proxy.moves")

DROP_WAIT = 30.0  # seconds a worker gets to drop sessions it no longer serves
BOUNDARY_POLL = 0.01  # seconds between looks at a moving session's running requests


class _Worker(Protocol):
    slot: int
    owner: str
    channel: Any


class MoveTable(Protocol):
    """What a move needs from the supervisor and the router."""

    def live(self) -> Sequence[_Worker]: ...

    def hold_sessions(self, session_ids: list[str]) -> None: ...

    def release_sessions(self, session_ids: list[str]) -> None: ...

    def running_requests(self, session_id: str) -> int: ...

    def place_session(self, session_id: str, owner: str) -> None: ...


class _Checkpoints(Protocol):
    busy: str | None

    @property
    def open_checkpoint(self) -> str | None: ...


@dataclass(eq=False)
class Mover:
    table: MoveTable
    checkpoints: _Checkpoints
    holding: int = 0  # sessions whose new requests wait at the proxy now
    _drops: set[asyncio.Future[None]] = field(default_factory=set)

    async def move(self, session_ids: list[str], to_slot: int, within: float) -> dict[str, Any]:
        """Move `session_ids` to the worker in `to_slot`; answer what moved and what did
        not, and why (module docstring)."""
        open_id = self.checkpoints.open_checkpoint
        if open_id is not None:
            raise GymError(
                "operation_conflict", f"checkpoint {open_id} is open; a move waits for resume"
            )
        if self.checkpoints.busy is not None:
            raise GymError("operation_conflict", f"a {self.checkpoints.busy} is running")
        target = next((w for w in self.table.live() if w.slot == to_slot), None)
        if target is None:
            raise GymError("invalid_request", f"no live worker in slot {to_slot}")
        wanted = list(dict.fromkeys(session_ids))
        started = time.monotonic()
        self.checkpoints.busy = "move"
        held = list(wanted)
        try:
            links = await self._links(wanted, within)
            held += [linked for ids in links.values() for linked in ids]
            self.table.hold_sessions(held)
            self.holding = len(held)
            moved, failed = await self._move(wanted, links, target, started + within)
        finally:
            self.table.release_sessions(held)
            self.holding = 0
            self.checkpoints.busy = None
        seconds = round(time.monotonic() - started, 6)
        log.info(
            "moved %d sessions to worker %d in %.3f s (%d not moved)",
            len(moved),
            to_slot,
            seconds,
            len(failed),
        )
        return {
            "to_slot": to_slot,
            "moved": moved,
            "failed": [{"session_id": s, "reason": r} for s, r in sorted(failed.items())],
            "seconds": seconds,
        }

    async def _links(self, wanted: list[str], within: float) -> dict[str, list[str]]:
        """Every worker's gym-proxy sessions that carried these app sessions' requests."""
        live = self.table.live()
        replies = await asyncio.gather(
            *(w.channel.request(LinkedSessions(wanted), within=within) for w in live),
            return_exceptions=True,
        )
        links: dict[str, list[str]] = {}
        for worker, reply in zip(live, replies, strict=True):
            if isinstance(reply, Links):
                for session_id, linked in reply.links.items():
                    links.setdefault(session_id, []).extend(linked)
            elif isinstance(reply, BaseException):
                log.warning("worker %d did not list linked sessions: %s", worker.slot, reply)
        return links

    async def _move(
        self, wanted: list[str], links: dict[str, list[str]], target: _Worker, deadline: float
    ) -> tuple[list[str], dict[str, str]]:
        failed: dict[str, str] = {}
        running = self.table.running_requests

        def busy_now(session_id: str) -> bool:
            return bool(running(session_id)) or any(running(s) for s in links.get(session_id, ()))

        while True:
            busy = [s for s in wanted if busy_now(s)]
            if not busy or time.monotonic() >= deadline:
                break
            await asyncio.sleep(BOUNDARY_POLL)
        for session_id in busy:
            failed[session_id] = "a request of the session was still running at the timeout"
        ready = [s for s in wanted if s not in failed]
        if not ready:
            return [], failed
        sources = [w for w in self.table.live() if w.owner != target.owner]
        within = max(0.1, deadline - time.monotonic())
        replies = await asyncio.gather(
            *(w.channel.request(MoveOut(ready), within=within) for w in sources),
            return_exceptions=True,
        )
        found: dict[str, tuple[_Worker, dict[str, Any]]] = {}
        silent = []
        for worker, reply in zip(sources, replies, strict=True):
            if isinstance(reply, SessionRecords):
                for record in reply.records:
                    found[record["session_id"]] = (worker, record)
            elif isinstance(reply, RemoteError):
                silent.append(f"worker {worker.slot} refused: {reply.detail}")
            elif isinstance(reply, ChannelClosed | ChannelTimeout):
                silent.append(f"worker {worker.slot} did not answer: {reply}")
            elif isinstance(reply, BaseException):
                raise reply
        for session_id in ready:
            if session_id not in found:
                why = "; ".join(silent) or f"no live worker but slot {target.slot}'s holds it"
                failed[session_id] = f"not found on another worker ({why})"
        records = [found[s][1] for s in ready if s in found]
        if not records:
            return [], failed
        within = max(0.1, deadline - time.monotonic())
        try:
            await target.channel.request(Adopt(records), within=within)
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            for record in records:
                failed[record["session_id"]] = f"worker {target.slot} did not take it: {exc}"
            # A target that answers late may still install them: it drops them after
            # (the channel serves its requests in order), so no stray copy stays.
            self._drop_later(target, [r["session_id"] for r in records])
            return [], failed
        moved = [r["session_id"] for r in records]
        for session_id in moved:
            for placed in (session_id, *links.get(session_id, ())):
                self.table.place_session(placed, target.owner)
        by_source: dict[int, tuple[_Worker, list[str]]] = {}
        for session_id in moved:
            source = found[session_id][0]
            by_source.setdefault(source.slot, (source, []))[1].append(session_id)
        for source, ids in by_source.values():
            # It gets none of their requests any more: the held ones need not wait for it.
            self._drop_later(source, ids)
        return sorted(moved), failed

    def _drop_later(self, worker: _Worker, session_ids: list[str]) -> None:
        drop = asyncio.ensure_future(self._drop(worker, session_ids))
        self._drops.add(drop)
        drop.add_done_callback(self._drops.discard)

    async def _drop(self, worker: _Worker, session_ids: list[str]) -> None:
        try:
            await worker.channel.request(Drop(session_ids), within=DROP_WAIT)
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            log.warning("worker %d kept %d sessions' state: %s", worker.slot, len(session_ids), exc)
