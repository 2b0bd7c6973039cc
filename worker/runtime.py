"""The participant runtime of one worker: the part that knows no web framework.

- **Admission.** While a checkpoint is open, every request waits at the door until resume:
  calls on existing sessions (a tool call never shows a refusal) and new work alike (a new
  session, a new episode `/run`, a model's generation call), because NeMo Gym's clients
  (0.7.0's rollout collection and agents) do not repeat a refused call: a 409 would fail
  the rollout. Nothing waiting at the door has started, so it never blocks a checkpoint.
- **Rollout identity.** A request names its rollout by `/ng-rollout/<key>/`, or in a
  `/run` or `/seed_session` body by `_ng_rollout_id`, else by NeMo Gym 0.7.0's
  `_ng_task_index` and `_ng_rollout_index` (rollout `"<task>-<rollout>"`, as NeMo Gym's
  `rollout_correlation` derives it), with `_ng_attempt_index`. A session seeded under one is
  bound to that episode.
- **Readiness.** The worker is ready when the gate is closed and every request in flight
  is parked at a boundary, inside a replay step, or waiting at the door. Reports carry a
  sequence number and the blockers (episode keys, sessions). While a checkpoint is open
  one is sent after every change a report shows (`changed`, coalesced to one per loop
  turn): a request admitted, parked (at the door, at a boundary, for its answer), in or
  out of a replay step, turned into a tunnel, or gone (answered, cancelled, retired, a
  tunnel closed); a session begun, bound or ended in the store, by a request, the app or
  the coordinator (`SessionStore.on_change`). Nothing re-sends them on a timer.
- **Tunnels.** A request that became a WebSocket is a tunnel: it has no boundary to park
  at, so at close the runtime closes it or reports it as a blocker, as the app's
  `Participation.tunnels` says.
- **State.** The session store (`worker.sessions`) holds what the app keeps through the
  runtime; an app that keeps its state elsewhere registers hooks (`Participation`), and an
  app with neither is restart-only: it never blocks, exports nothing, and reports as
  restarts the episodes of its live sessions and of its requests in flight. A live session
  of a restart-only resources server bound to no episode is state nothing would save or
  restart: it is a blocker (`resources-unbound-sessions:<n>`) until it ends.

The aiohttp and ASGI front doors (`worker.aiohttp_door`, `worker.asgi_door`) turn a
request into `RequestFacts`, call `admit`, run the app, then `answered` and `leave`.
Coordinator messages are served by `worker.channel_requests`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gym_proxy.coordinator.contract.channel import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    RemoteError,
)
from gym_proxy.coordinator.contract.episodes import EpisodeId, body_identity, parse_episode_key
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.loop_lag import LoopLag
from gym_proxy.coordinator.contract.marks import RestoredClaims, RetireMarks
from gym_proxy.coordinator.contract.messages import Claim, Ready, Report, SessionsEnded
from gym_proxy.coordinator.contract.records import encode
from gym_proxy.worker.declaration import Participation
from gym_proxy.worker.episodes import Episode
from gym_proxy.worker.handovers import EpisodeHandover
from gym_proxy.worker.identity import WorkerInfo
from gym_proxy.worker.moved_away import MovedAway
from gym_proxy.worker.session_load import SessionLoad
from gym_proxy.worker.sessions import SessionEntry, SessionStore, session_record

__all__ = [
    "InFlight",
    "ParticipantRuntime",
    "RequestFacts",
    "own_cancellation",
]

log = logging.getLogger("gym_proxy.participant")
access = logging.getLogger("gym_proxy.worker.access")

# Seconds ended sessions are collected before the proxy is told. A batching delay, not a
# poll: the first session that ends starts one timer, which sends the batch and stops; a
# worker whose sessions do not end runs none. Readiness never waits on it (`changed`).
ENDED_FLUSH = 0.2
CLAIM_WAIT = 30.0
RUN_BODY_LIMIT = 64 * 1024 * 1024
# Routes that end a session when they answer 2xx (NeMo Gym's session lifecycle);
# `/verify` ends it only on a resources server.
# A model participant's generation routes (NeMo Gym's): only these are checkpointed work;
# a model server's other routes (model lists, health, a judge) keep serving.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/messages"})
_CLOSE_PATHS = frozenset({"/close_session"})
# Bodies that may name the request's rollout (read ahead by the front doors).
_IDENTITY_PATHS = frozenset({"/run", "/seed_session"})
_RESOURCES_CLOSE_PATHS = frozenset({"/close_session", "/verify"})


# Where a request in flight stands: running the app, waiting at the door (not started),
# parked at a boundary, inside a replay step, or a WebSocket tunnel.
Position = Literal["running", "door", "parked", "replay", "tunnel"]


@dataclass(slots=True)
class RequestFacts:
    """What admission needs to know about a request, from whichever framework."""

    method: str
    path: str  # without the /ng-rollout/<key> prefix
    session_id: str | None  # x-ng-session-id: the gym-proxy session of a verified token
    new_session: bool  # x-ng-session-new: the proxy minted the session for this request
    episode_key: str | None  # from the /ng-rollout/<key>/ prefix
    # The request carries an app's own X-NeMo-Gym-Session-Token (the proxy passes those on)
    app_token: bool = False
    # x-ng-app-session-claim: the app session the request's own token or cookie names,
    # when the proxy routed it by that (unverified: the app checks its own token)
    app_session: str | None = None


@dataclass(slots=True, eq=False)
class InFlight:
    """One request being handled: what it is and where it stands."""

    task: asyncio.Task[Any] | None
    session_id: str | None  # its gym-proxy session (from a token the proxy verified)
    identity: EpisodeId | None
    path: str
    new_session: bool = False
    app_token: bool = False  # routed by (or carrying) an app's own session token
    # The session as the store keys it (`ParticipantRuntime.app_keyed`): the gym-proxy
    # session, or the app session its own token or cookie claims (None until known)
    key: str | None = None
    position: Position = "running"
    episode: Episode | None = None
    retired: bool = False
    close_tunnel: Callable[[], None] | None = None  # set once it became a tunnel
    handover: EpisodeHandover | None = None  # its episode is being handed over (worker.handovers)
    responding: bool = False  # its answer has begun (a hand-over can no longer replay it)
    replayable: bool = True  # False: its body cannot be handed back as it came
    admitted_at: float = 0.0  # time.monotonic() at admission (worker.session_load)

    def blocker(self) -> str:
        if self.identity is not None:
            return self.identity.key
        session = self.key or self.session_id
        if self.position == "tunnel":
            return f"tunnel:{session or self.path}"
        if session is not None:
            return f"session:{session}"
        return f"request:{self.path}"


@dataclass(eq=False)
class ParticipantRuntime:
    """Admission, readiness and state of one worker (see the module docstring)."""

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
    # until the controller forgets the rollout.
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
    # sampled once serving (process); read by the Stats of a scrape and by the pings
    loop_lag: LoopLag = field(default_factory=lambda: LoopLag(("scrape", "ping")))
    # What each session costs the worker lately, for the proxy's rebalance (`held`).
    load: SessionLoad = field(default_factory=SessionLoad)
    seq: int = 0
    _report_due: bool = False

    _ended: list[str] = field(default_factory=list)
    # One line per answered request (logger gym_proxy.worker.access): which worker served
    # which session, from the worker's side.
    access_log: bool = False

    def __post_init__(self) -> None:
        self.opened.set()
        self.store.on_end = self._sessions_ended
        self.store.on_change = self._store_changed
        self.loop_lag.on_sample = lambda due, now: self.load.sampled(due, now, self.flights)

    @property
    def kind(self) -> str:
        return self.participation.kind

    # ---- admission --------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self.opened.is_set()

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
        self.changed()  # in flight from now on (a model's other routes run while closed)
        try:
            if not self.is_open and (self.kind != "model" or facts.path in GENERATION_PATHS):
                # New work waits too (see the module docstring); a model server's other
                # routes (model lists, health, a judge) are not checkpointed work.
                await self.park(flight, "door")
            if identity is not None:
                restored, state = False, None
                if new_episode and identity.rollout_id in self.claims:
                    state = await self._claim(identity, digest)
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

    async def _claim(self, identity: EpisodeId, digest: str) -> Any:
        self.claims.check(identity)
        assert self.channel is not None
        try:
            claim = Claim(identity.rollout_id, identity.attempt, digest)
            reply = await self.channel.request(claim, within=CLAIM_WAIT)
        except (ChannelClosed, ChannelTimeout) as exc:
            raise GymError(
                "checkpoint_coordinator_unavailable", f"the claim got no answer: {exc}"
            ) from exc
        except RemoteError as exc:
            if exc.code == "stale_attempt":
                # The coordinator no longer holds it (claimed elsewhere, retired); a parked
                # claim or a replacement of another task leaves the record where it is.
                self.claims.take(identity.rollout_id)
            raise GymError(exc.code, exc.detail) from exc
        self.claims.take(identity.rollout_id)
        return reply.boundary

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
        self.changed()

    async def park(self, flight: InFlight, position: Position) -> float:
        """Wait while the gate is closed, or while the flight's episode is held for a
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
                    await self.opened.wait()
                else:
                    break
        finally:
            self.set_position(flight, "running")
        return time.monotonic() - started

    def set_position(self, flight: InFlight, position: Position) -> None:
        flight.position = position
        if flight.handover is not None and position == "parked":
            flight.handover.parked.set()
        self.changed()

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

    async def expire_sessions(self, ttl: float) -> None:
        """End sessions idle for `ttl` seconds, now and then (never while closed: the
        state a checkpoint exports stays as it was at close)."""
        while True:
            await asyncio.sleep(min(ttl / 4, 10.0))
            if self.is_open:
                busy = {f.key for f in self.flights if f.key is not None}
                self.store.expire(time.monotonic() - ttl, busy)

    # ---- readiness --------------------------------------------------------------
    def report(self) -> Report:
        """This worker's readiness for the open checkpoint (its sequence number is the last
        report sent)."""
        counts = {"in_flight": 0, "running": 0, "door": 0, "parked": 0, "replay": 0, "tunnel": 0}
        blockers = []
        # A model's calls never block: admitted ones finish and their answers are held
        # until resume (`hold_answer`), and the caller repeats an undelivered one.
        restart_only = self.participation.restart_only
        never_blocks = restart_only or self.kind == "model"
        restarts = set(self.store.episodes()) if restart_only else set()
        for flight in self.flights:
            counts["in_flight"] += 1
            counts[flight.position] += 1
            # A tunnel blocks until it is gone (closing one takes a moment; "block" waits
            # for the client), except on a restart-only participant, which never blocks.
            if flight.position in ("running", "tunnel") and not never_blocks:
                blockers.append(flight.blocker())
            if restart_only and flight.identity is not None:
                restarts.add(flight.identity.key)
        counts["sessions"] = len(self.store)
        if restart_only:
            unbound = self.store.unbound()
            counts["unbound_sessions"] = unbound
            if unbound and self.kind == "resources":
                blockers.append(f"resources-unbound-sessions:{unbound}")
        return Report(
            seq=self.seq,
            checkpoint_id=self.checkpoint_id,
            ready=not self.is_open and not blockers,
            blockers=sorted(blockers),
            counts=counts,
            restarts=sorted(restarts),
        )

    def _sessions_ended(self, session_ids: list[str]) -> None:
        """Sessions ended here: the app's `release` hook drops their state, and the proxy
        is told soon (batched), so its routing table of app and placed sessions does not
        keep them forever (an MCP token or cookie of an ended session is then routed as a
        new one)."""
        hooks = self.participation.hooks
        if hooks is not None and hooks.release is not None:
            hooks.release(session_ids)
        for session_id in session_ids:
            self.links.pop(session_id, None)
        if not self._ended:
            with contextlib.suppress(RuntimeError):  # no loop: nobody to tell
                asyncio.get_running_loop().call_later(ENDED_FLUSH, self._send_ended)
        self._ended += session_ids

    def _send_ended(self) -> None:
        ended, self._ended = self._ended, []
        store = self.store
        ended = [sid for sid in ended if sid not in store]  # begun again meanwhile: keep
        if ended and self.channel is not None and not self.channel.closed:
            with contextlib.suppress(ChannelClosed):
                self.channel.notify(SessionsEnded(ended))

    def changed(self) -> None:
        """Something readiness depends on changed: report soon (coalesced)."""
        if self.is_open or self._report_due or self.channel is None:
            return
        self._report_due = True
        asyncio.get_running_loop().call_soon(self._send_report)

    def _send_report(self) -> None:
        self._report_due = False
        if self.channel is None or self.channel.closed or self.checkpoint_id is None:
            return
        self.seq += 1
        with contextlib.suppress(ChannelClosed):
            self.channel.notify(Ready(**self.report().fields()))

    def _store_changed(self) -> None:
        # Looked up on each call, not bound once: `changed` is what a report follows.
        self.changed()

    def close_gate(self, checkpoint_id: str) -> None:
        self.checkpoint_id = checkpoint_id
        if self.is_open:
            self.opened.clear()
            for flight in list(self.flights):
                if flight.position == "tunnel":
                    self._close_tunnel(flight)
        self.changed()  # a worker that joins an open checkpoint reports at once

    def open_gate(self) -> None:
        self.checkpoint_id = None
        self.opened.set()

    # ---- state ------------------------------------------------------------------
    async def export(self, scope: set[str] | None) -> list[dict[str, Any]]:
        """Records of this worker's sessions and parked episodes within `scope`."""
        participation = self.participation
        owner = self.info.owner
        if participation.restart_only:
            return []  # its episodes are restarts (report.restarts), never continued
        elif participation.hooks is not None and participation.hooks.export is not None:
            records = await self._hook_records(self.store.sessions_in(scope))
        else:
            records = self.store.export(owner, scope)
        for flight in self.flights:
            ep = flight.episode
            if ep is not None and ep.exported and (scope is None or ep.key in scope):
                records.append(ep.export())
        # Handed over to this worker, its request not here yet: it is this worker's now.
        records += [r for key, r in self.arrivals.items() if scope is None or key in scope]
        return records

    async def _hook_records(self, entries: dict[str, SessionEntry]) -> list[dict[str, Any]]:
        """Records of these sessions with their state from the app's export hook (a
        session the hook does not answer for is left out)."""
        hooks = self.participation.hooks
        assert hooks is not None and hooks.export is not None
        states = await hooks.export(sorted(entries))
        owner = self.info.owner
        return [
            session_record(sid, entries[sid].episode, value, owner)
            for sid, value in states.items()
            if sid in entries
        ]

    async def install(self, records: list[dict[str, Any]], restored: bool = True) -> int:
        """Install restored sessions, or (not `restored`) live ones moved here: all or
        nothing (the hook raises to refuse)."""
        hooks = self.participation.hooks
        if hooks is not None and hooks.restore is not None:
            await hooks.restore({r["session_id"]: r.get("state") for r in records})
            records = [{**r, "state": None} for r in records]
        installed = self.store.install(records, restored)
        self.moved_away.discard(r["session_id"] for r in records)
        return installed

    async def export_sessions(self, session_ids: list[str]) -> list[dict[str, Any]]:
        """Records of those of `session_ids` this worker holds, for a move; it keeps them
        (and serves them) until told to drop them."""
        held = self.store.entries(session_ids)
        if not held:
            return []
        participation = self.participation
        if participation.restart_only:
            raise GymError(
                "session_not_movable",
                "the app declares no session state (restart-only): its sessions cannot move",
            )
        busy = sorted({f.key for f in self.flights if f.key in held})
        if busy:
            raise GymError("session_not_movable", f"sessions with a request running: {busy}")
        return await self.session_records(held)

    async def session_records(self, held: dict[str, SessionEntry]) -> list[dict[str, Any]]:
        """The records of these live sessions, for a move (the store's values, or the
        app's export hook's)."""
        owner = self.info.owner
        participation = self.participation
        if participation.hooks is not None and participation.hooks.export is not None:
            found = await self._hook_records(held)
        else:
            found = [session_record(s, e.episode, e.value, owner) for s, e in held.items()]
        encode(found, self.kind)  # a state that is not JSON fails here, naming the session
        return found

    async def drop_sessions(self, session_ids: list[str]) -> int:
        """These sessions moved away: end them here (the app's hooks free their state)."""
        dropped = [sid for sid in session_ids if self.store.delete(sid)]
        self.moved_away.add(dropped)
        return await self.forget_sessions(dropped)

    async def forget_sessions(self, session_ids: list[str]) -> int:
        """The store dropped these sessions: tell the app's hook too (idempotent)."""
        hooks = self.participation.hooks
        if session_ids and hooks is not None and hooks.retire is not None:
            await hooks.retire(session_ids)
        return len(session_ids)

    async def retire(self, episode_ids: list[EpisodeId]) -> int:
        """Mark the attempts (and earlier ones of their rollouts) retired, cancel their
        requests, wait for them to stop, then free their sessions; return what was freed.
        The marks stay, whether or not this finishes, until `forget`."""
        self.marks.retire(episode_ids)
        covered = self.marks.covers
        doomed = [f for f in self.flights if f.identity is not None and covered(f.identity)]
        for flight in doomed:
            flight.retired = True
            if flight.task is not None:
                flight.task.cancel()
        tasks = [f.task for f in doomed if f.task is not None]
        if tasks:
            await asyncio.wait(tasks)
        keys = {key for key in self.store.episodes() if covered(parse_episode_key(key))}
        for session_id, key in self.store.bound_to(keys).items():
            self.retired_sessions[session_id] = parse_episode_key(key).rollout_id
        freed = self.store.release_episodes(keys)
        self.claims.drop_retired(self.marks)
        for key in [k for k in self.arrivals if covered(parse_episode_key(k))]:
            del self.arrivals[key]
        return await self.forget_sessions(freed) + len(doomed)

    def forget(self, rollout_ids: list[str]) -> list[str]:
        """Stop refusing these rollouts' retired attempts and sessions."""
        gone = set(rollout_ids)
        self.marks.forget(gone)
        for session_id, rollout_id in list(self.retired_sessions.items()):
            if rollout_id in gone:
                del self.retired_sessions[session_id]
        return sorted(gone)

    async def stop(self) -> None:
        """A commit with `stop: true` was written: free what the app can free."""
        hooks = self.participation.hooks
        if hooks is not None and hooks.stop is not None:
            await hooks.stop()


def own_cancellation(flight: InFlight) -> bool:
    """True when the runtime cancelled the current task (a retire, or a hand-over giving
    its episode up) and nothing else did; the cancellation is then taken back so the
    front door can answer (`stale_attempt`, or the hand-over marker)."""
    task = asyncio.current_task()
    stopped = flight.retired or (flight.handover is not None and flight.handover.id is not None)
    if stopped and task is not None and task.cancelling() == 1:
        task.uncancel()
        return True
    return False
