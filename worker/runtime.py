"""The participant runtime of one worker: the part that knows no web framework.

`ParticipantRuntime` is the state one worker's runtime keeps (its requests in flight, its
session store, the claims and retire marks, the sessions moved away, the episodes handed
over to it) and the way of a request through it, which the aiohttp and ASGI front doors
(`worker.aiohttp_door`, `worker.asgi_door`) take: they turn a request into
`RequestFacts` (`worker.flights`), call `admit`, run the app, then `answered` and
`leave`. Its other concerns are a module each: the readiness reports
(`worker.readiness`), the sessions that end (`worker.session_ends`), the state's records
out and in (`worker.state_records`), restored claims and retired attempts
(`worker.attempts`) and the episode hand-overs (`worker.handovers`); coordinator
messages are served by `worker.channel_requests`.

- **Admission.** While a checkpoint is open (the door closed: `close_door`), every request
  waits at the door until resume: calls on existing sessions (a tool call never shows a
  refusal) and new work alike (a new session, a new episode `/run`, a model's generation
  call), because NeMo Gym's clients (0.7.0's rollout collection and agents) do not repeat
  a refused call: a 409 would fail the rollout. Nothing waiting at the door has started,
  so it never blocks a checkpoint.
- **Rollout identity.** A request names its rollout by `/ng-rollout/<key>/`, or in a
  `/run` or `/seed_session` body by `_ng_rollout_id`, else by NeMo Gym 0.7.0's
  `_ng_task_index` and `_ng_rollout_index` (rollout `"<task>-<rollout>"`, as NeMo Gym's
  `rollout_correlation` derives it), with `_ng_attempt_index`. A session seeded under one is
  bound to that episode.
- **Tunnels.** A request that became a WebSocket is a tunnel: it has no boundary to park
  at, so at close the runtime closes it or reports it as a blocker, as the app's
  `Participation.tunnels` says.
- **State.** The session store (`worker.sessions`) holds what the app keeps through the
  runtime; an app that keeps its state elsewhere registers hooks (`Participation`), and an
  app with neither is restart-only (`worker.readiness` says how it reports).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gym_proxy.coordinator.contract.channel import Channel
from gym_proxy.coordinator.contract.episodes import EpisodeId, body_identity, parse_episode_key
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.loop_lag import LoopLag
from gym_proxy.coordinator.contract.marks import RestoredClaims, RetireMarks
from gym_proxy.worker import attempts
from gym_proxy.worker.declaration import Participation
from gym_proxy.worker.episodes import Episode
from gym_proxy.worker.flights import InFlight, Position, RequestFacts, own_cancellation
from gym_proxy.worker.identity import WorkerInfo
from gym_proxy.worker.moved_away import MovedAway
from gym_proxy.worker.readiness import Readiness
from gym_proxy.worker.session_ends import SessionEnds
from gym_proxy.worker.session_load import SessionLoad
from gym_proxy.worker.sessions import SessionStore

__all__ = ["ParticipantRuntime", "GENERATION_PATHS", "RUN_BODY_LIMIT"]

access = logging.getLogger("gym_proxy.worker.access")

RUN_BODY_LIMIT = 64 * 1024 * 1024
# A model participant's generation routes (NeMo Gym's): only these are checkpointed work;
# a model server's other routes (model lists, health, a judge) keep serving.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/messages"})
# Routes that end a session when they answer 2xx (NeMo Gym's session lifecycle);
# `/verify` ends it only on a resources server.
_CLOSE_PATHS = frozenset({"/close_session"})
_RESOURCES_CLOSE_PATHS = frozenset({"/close_session", "/verify"})
# Bodies that may name the request's rollout (read ahead by the front doors).
_IDENTITY_PATHS = frozenset({"/run", "/seed_session"})


@dataclass(eq=False)
class ParticipantRuntime:
    """One worker's runtime: its state, and the way of a request through it (the module
    docstring); `readiness` and `ends` are its readiness reports and its sessions' ends."""

    info: WorkerInfo
    participation: Participation = field(default_factory=Participation)
    # The app keeps its own sessions (a Starlette session cookie, as NeMo Gym's servers):
    # the store, the records and the sessions told to the proxy are the app's session IDs,
    # never gym-proxy's; else they are gym-proxy's, never the app's (`answered`).
    app_keyed: bool = False
    store: SessionStore = field(default_factory=SessionStore)
    flights: set[InFlight] = field(default_factory=set)
    channel: Channel | None = None
    checkpoint_id: str | None = None
    claims: RestoredClaims[None] = field(default_factory=RestoredClaims)
    # Retire marks and the sessions of retired attempts (session -> rollout): refused
    # until the controller forgets the rollout (`worker.attempts`).
    marks: RetireMarks = field(default_factory=RetireMarks)
    retired_sessions: dict[str, str] = field(default_factory=dict)
    # Sessions that moved to another worker: refused here (`worker.moved_away`).
    moved_away: MovedAway = field(default_factory=MovedAway)
    # An app session -> the gym-proxy sessions its requests came under (moved with it).
    links: dict[str, set[str]] = field(default_factory=dict)
    # Episode key -> the record of an episode handed over to this worker, until its
    # request (replayed by the proxy) takes it (worker.handovers).
    arrivals: dict[str, dict[str, Any]] = field(default_factory=dict)
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    # gym-proxy stops for good (`stop_waiting`): no resume will come.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    # sampled once serving (process); read by the Stats of a scrape and by the pings
    loop_lag: LoopLag = field(default_factory=lambda: LoopLag(("scrape", "ping")))
    # What each session costs the worker lately, for the proxy's rebalance (`held`).
    load: SessionLoad = field(default_factory=SessionLoad)
    # One line per answered request (logger gym_proxy.worker.access): which worker served
    # which session, from the worker's side.
    access_log: bool = False
    readiness: Readiness = field(init=False)
    ends: SessionEnds = field(init=False)

    def __post_init__(self) -> None:
        self.readiness = Readiness(self)
        self.ends = SessionEnds(self)
        self.opened.set()
        self.store.on_end = self.ends.ended
        # Looked up on each call, not bound once: `changed` is what a report follows.
        self.store.on_change = lambda: self.readiness.changed()
        self.loop_lag.on_sample = lambda due, now: self.load.sampled(due, now, self.flights)

    @property
    def kind(self) -> str:
        return self.participation.kind

    # ---- the door -----------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self.opened.is_set()

    def close_door(self, checkpoint_id: str) -> None:
        self.checkpoint_id = checkpoint_id
        if self.is_open:
            self.opened.clear()
            for flight in list(self.flights):
                if flight.position == "tunnel":
                    self._close_tunnel(flight)
        self.readiness.changed()  # a worker that joins an open checkpoint reports at once

    def open_door(self) -> None:
        self.checkpoint_id = None
        self.opened.set()

    def stop_waiting(self) -> None:
        """gym-proxy stops for good: nothing resumes an open checkpoint, so what waits for
        the resume (at the door, parked at a boundary) is answered now rather than held
        through the stop's grace period and then cut."""
        self.stopping.set()

    # ---- a request's way through ------------------------------------------------
    async def admit(
        self, facts: RequestFacts, read_body: Callable[[], Awaitable[bytes]]
    ) -> InFlight:
        """Let a request in, park it at the door, or refuse it (GymError); track it."""
        digest = ""
        if facts.episode_key:
            identity: EpisodeId | None = parse_episode_key(facts.episode_key)
        elif facts.path in _IDENTITY_PATHS and facts.method == "POST":
            identity, digest = body_identity(await read_body())
        else:
            identity = None
        self._refuse_retired(identity, facts)
        new_episode = identity is not None and facts.path == "/run"
        flight = InFlight(
            asyncio.current_task(),
            facts.session_id,
            identity,
            facts.path,
            facts.new_session,
            facts.app_token,
            key=self._key(facts),
            admitted_at=time.monotonic(),
        )
        self.flights.add(flight)
        self.readiness.changed()  # in flight from now on (a model's other routes run while closed)
        try:
            if not self.is_open and (self.kind != "model" or facts.path in GENERATION_PATHS):
                # New work waits too (see the module docstring); a model server's other
                # routes (model lists, health, a judge) are not checkpointed work.
                await self.park(flight, "door")
            if identity is not None:
                restored, state = False, None
                if new_episode and identity.rollout_id in self.claims:
                    state = await attempts.claim(self, identity, digest)
                    restored = True
                elif new_episode and identity.key in self.arrivals:
                    state = self.arrivals.pop(identity.key)["boundary"]  # handed over
                    restored = True
                flight.episode = Episode(
                    self, flight, identity, restored, state, digest, exported=new_episode
                )
        except asyncio.CancelledError:
            self.leave(flight)
            if own_cancellation(flight):  # retired while it waited: refused, not dropped
                raise GymError("stale_attempt", f"attempt {flight.blocker()} was retired") from None
            raise
        except BaseException:
            self.leave(flight)
            raise
        return flight

    def _key(self, facts: RequestFacts) -> str | None:
        """The request's session in the store's namespace, as far as its head says."""
        return facts.app_session if self.app_keyed else facts.session_id

    def _refuse_retired(self, identity: EpisodeId | None, facts: RequestFacts) -> None:
        """A retired attempt (or an earlier one) is refused until its rollout is forgotten;
        so is a session of one (MCP calls name only their session), except its close."""
        if identity is not None and self.marks.covers(identity):
            raise GymError("stale_attempt", f"attempt {identity.key} was retired")
        key = self._key(facts)
        if key in self.retired_sessions and facts.path != "/close_session":
            raise GymError("stale_attempt", f"session {key} belongs to a retired attempt")
        if key in self.moved_away and not facts.new_session:
            raise GymError(
                "session_owner_gone",
                f"session {key} moved away from this worker, and the worker that took it is gone",
            )

    def answered(self, flight: InFlight, status: int, app_session: str | None = None) -> None:
        """The app answered `status`: track the request's session.

        Which session is the store's namespace's (`app_keyed`), and is taken only from a
        verified source: gym-proxy's from the token the proxy verified (tracked once its
        token comes back, so a client that never returns its cookie does not grow the
        store); the app's from the session cookie the app itself set in this answer
        (`app_session`: the app signed it), tracked from its first 2xx `/seed_session`. A
        2xx `/close_session` (or a resources `/verify`) ends the session (NeMo Gym's
        lifecycle); a request sent under an episode binds it. What a request's own app
        token claims (`flight.key` without a cookie, an MCP call) only keeps a session it
        names in use: nobody verified it here, so it never binds or ends one."""
        if self.app_keyed:
            sid = app_session
            tracked = sid is not None and (flight.path == "/seed_session" or sid in self.store)
        else:
            sid = flight.session_id
            tracked = not flight.new_session
        if self.access_log:
            shown = flight.key or sid  # an MCP call's answer sets a cookie of no session
            access.info("worker %d %s %d session=%s", self.info.slot, flight.path, status, shown)
        if not 200 <= status < 300:
            return
        if sid is None or not tracked:
            claimed = flight.key
            if claimed is not None and claimed in self.store:
                self.store.touch(claimed)
            if sid is None:
                return
        if self.ends_session(flight.path):
            self.store.delete(sid)
            return
        episode = flight.identity.key if flight.identity is not None else None
        if tracked:
            self.store.touch(sid, episode)
            proxy_session = flight.session_id
            if self.app_keyed and proxy_session is not None:
                self.links.setdefault(sid, set()).add(proxy_session)
            if episode is not None:
                self.store.bind(sid, episode)

    def ends_session(self, path: str) -> bool:
        """Whether a 2xx answer to `path` ends its session."""
        return path in (_RESOURCES_CLOSE_PATHS if self.kind == "resources" else _CLOSE_PATHS)

    def leave(self, flight: InFlight) -> None:
        if flight in self.flights:
            self.flights.discard(flight)
            self.load.ended(flight, time.monotonic())
        self.readiness.changed()

    async def park(self, flight: InFlight, position: Position) -> float:
        """Wait while the door is closed, or while the flight's episode is held for a
        hand-over; return the seconds spent parked."""
        if self.is_open and flight.handover is None:
            return 0.0
        started = time.monotonic()
        self.set_position(flight, position)
        try:
            while True:
                handover = flight.handover
                if handover is not None:
                    await handover.go_on.wait()  # or cancelled, when it is handed over
                elif not self.is_open:
                    if self.stopping.is_set():
                        raise _stopping(self.checkpoint_id, position)
                    await _first(self.opened, self.stopping)
                else:
                    break
        finally:
            self.set_position(flight, "running")
        return time.monotonic() - started

    def set_position(self, flight: InFlight, position: Position) -> None:
        flight.position = position
        if flight.handover is not None and position == "parked":
            flight.handover.parked.set()
        self.readiness.changed()

    async def hold_answer(self, flight: InFlight) -> None:
        """A model's generation answer waits while a checkpoint is open (delivered after
        resume)."""
        if self.kind == "model" and not self.is_open and flight.path in GENERATION_PATHS:
            await self.park(flight, "parked")

    def tunnel_opened(self, flight: InFlight, close: Callable[[], None]) -> None:
        """The request became a WebSocket; `close` ends it from the server side."""
        flight.close_tunnel = close
        self.set_position(flight, "tunnel")
        if not self.is_open:
            self._close_tunnel(flight)

    def close_tunnels(self, session_ids: set[str]) -> None:
        """Close these sessions' tunnels, as a checkpoint would (they are moving)."""
        for flight in list(self.flights):
            if flight.position == "tunnel" and (
                flight.session_id in session_ids or flight.key in session_ids
            ):
                self._close_tunnel(flight)

    def _close_tunnel(self, flight: InFlight) -> None:
        if self.participation.tunnels == "close" and flight.close_tunnel is not None:
            close, flight.close_tunnel = flight.close_tunnel, None
            close()


def _stopping(checkpoint_id: str | None, position: Position) -> GymError:
    where = (
        "this call waited at the door and did not start"
        if position == "door"
        else "this call was parked for the checkpoint and goes no further"
    )
    return GymError(
        "server_stopping",
        f"gym-proxy is stopping while checkpoint {checkpoint_id} is open: {where}",
    )


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
