"""The participant runtime every worker runs around its app.

- **Admission gate.** While a checkpoint is open, requests that would start something
  (a new session, a new episode `/run`, a claim) get 409 `checkpoint_parked` with
  `Retry-After`; calls on existing sessions wait at the door until resume, so a tool call
  never shows a refusal to the model.
- **Readiness.** The worker is ready when the gate is closed and every request in flight
  is parked at a boundary, inside a replay step, or waiting at the door. Reports carry a
  sequence number and the blockers (episode keys, sessions); they are sent on every change
  and re-sent on a short poll while the checkpoint is open.
- **Coordinator messages**: close, reopen, export, release, install, uninstall, tables,
  retire (handled in `worker.participant_messages`).

App authors use `current_session(request)`, `episode(request)` and `PARTICIPANT_KIND`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from coordinator.channel import Channel, ChannelClosed, ChannelTimeout, RemoteError
from coordinator.episode_ids import EpisodeId, parse_episode_key
from coordinator.errors import RETRY_AFTER, GymError
from worker.episodes import Episode
from worker.identity import WorkerInfo
from worker.sessions import SessionStore

__all__ = [
    "PARTICIPANT_KIND",
    "RUNTIME",
    "InFlight",
    "ParticipantRuntime",
    "RequestSession",
    "current_session",
    "episode",
    "participant_middleware",
]

log = logging.getLogger("gym_proxy.participant")

PARTICIPANT_KIND = web.AppKey("gym_proxy_participant_kind", str)
REPORT_POLL = 0.2
CLAIM_WAIT = 30.0
# Routes that end a session when they answer 2xx (NeMo Gym's session lifecycle);
# `/verify` ends it only on a resources server.
_CLOSE_PATHS = frozenset({"/close_session"})
_RESOURCES_CLOSE_PATHS = frozenset({"/close_session", "/verify"})
_FLIGHT = "gym_proxy.flight"
_NEW_SESSION_HEADER = "x-ng-session-new"
_EPISODE_HEADER = "x-ng-episode-key"


def error_response(error: GymError) -> web.Response:
    """The JSON answer to a refusal (status and Retry-After from the one table)."""
    return web.Response(
        status=error.status,
        body=error.body(),
        content_type="application/json",
        headers={"Retry-After": "1"} if error.code in RETRY_AFTER else None,
    )


@dataclass(slots=True, eq=False)
class InFlight:
    """One request being handled: what it is and where it stands."""

    task: asyncio.Task[Any] | None
    session_id: str | None
    identity: EpisodeId | None
    path: str
    position: str = "running"  # running | door | parked | replay
    episode: Episode | None = None
    retired: bool = False

    def blocker(self) -> str:
        if self.identity is not None:
            return f"episode:{self.identity.key}"
        if self.session_id is not None:
            return f"session:{self.session_id}"
        return f"request:{self.path}"


@dataclass(eq=False)
class ParticipantRuntime:
    """Admission, readiness and state of one worker (see the module docstring)."""

    info: WorkerInfo
    kind: str = "resources"
    store: SessionStore = field(default_factory=SessionStore)
    flights: set[InFlight] = field(default_factory=set)
    channel: Channel | None = None
    checkpoint_id: str | None = None
    pending: dict[str, int] = field(default_factory=dict)  # restored rollout -> attempt
    retiring: set[str] = field(default_factory=set)
    aliases: dict[str, str] = field(default_factory=dict)
    sessions: dict[str, str] = field(default_factory=dict)
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    seq: int = 0
    _report_due: bool = False
    _poller: asyncio.Task[None] | None = None
    _sends: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.opened.set()

    # ---- admission --------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self.opened.is_set()

    async def admit(self, request: web.Request) -> InFlight:
        """Let a request in, park it at the door, or refuse it; track it while it runs."""
        sid = request.headers.get("x-ng-session-id")
        new_session = request.headers.get(_NEW_SESSION_HEADER) == "1"
        key = request.headers.get(_EPISODE_HEADER)
        if key:
            identity: EpisodeId | None = parse_episode_key(key)
        elif request.path == "/run" and request.method == "POST":
            identity = await _run_identity(request)
        else:
            identity = None
        starts = new_session or (identity is not None and request.path == "/run")
        if identity is not None and identity.key in self.retiring:
            raise GymError("stale_attempt", f"attempt {identity.key} is being retired")
        flight = InFlight(asyncio.current_task(), sid, identity, request.path)
        if not self.is_open:
            if starts:
                raise GymError("checkpoint_parked", "a checkpoint is in progress")
            self.flights.add(flight)
            await self.park(flight, "door")
        else:
            self.flights.add(flight)
        try:
            if identity is not None:
                restored, state = False, None
                if request.path == "/run" and identity.rollout_id in self.pending:
                    state = await self._claim(identity)
                    restored = True
                flight.episode = Episode(self, flight, identity, restored, state)
            if sid is not None and not new_session:
                self.store.touch(sid, identity.key if identity else None)
        except BaseException:
            self.leave(flight)
            raise
        request[_FLIGHT] = flight
        return flight

    async def _claim(self, identity: EpisodeId) -> Any:
        expected = self.pending[identity.rollout_id]
        if identity.attempt != expected:
            raise GymError(
                "stale_attempt", f"{identity.rollout_id} continues only as attempt {expected}"
            )
        assert self.channel is not None
        try:
            reply = await self.channel.request(
                "claim",
                within=CLAIM_WAIT,
                rollout_id=identity.rollout_id,
                attempt=identity.attempt,
            )
        except (ChannelClosed, ChannelTimeout) as exc:
            raise GymError(
                "checkpoint_coordinator_unavailable", f"the claim got no answer: {exc}"
            ) from exc
        except RemoteError as exc:
            if exc.code != "checkpoint_parked":
                # The coordinator no longer holds it (claimed elsewhere, retired).
                self.pending.pop(identity.rollout_id, None)
            raise GymError(exc.code, exc.detail) from exc
        self.pending.pop(identity.rollout_id, None)
        return reply.get("state")

    async def expire_sessions(self, ttl: float) -> None:
        """End sessions idle for `ttl` seconds, now and then (never while closed: the
        state a checkpoint exports stays as it was at close)."""
        while True:
            await asyncio.sleep(min(ttl / 4, 10.0))
            if self.is_open:
                busy = {f.session_id for f in self.flights if f.session_id is not None}
                self.store.expire(time.monotonic() - ttl, busy)

    def ended(self, path: str, status: int, flight: InFlight) -> None:
        """A request answered: a 2xx `/close_session` (or a resources `/verify`) ends its
        session, so session stores shrink as NeMo Gym's clients finish with them."""
        if 200 <= status < 300 and flight.session_id is not None:
            closers = _RESOURCES_CLOSE_PATHS if self.kind == "resources" else _CLOSE_PATHS
            if path in closers:
                self.store.delete(flight.session_id)

    def leave(self, flight: InFlight) -> None:
        self.flights.discard(flight)
        self.changed()

    async def park(self, flight: InFlight, position: str) -> float:
        """Wait while the gate is closed; return the seconds spent parked."""
        if self.is_open:
            return 0.0
        started = time.monotonic()
        self.set_position(flight, position)
        try:
            await self.opened.wait()
        finally:
            self.set_position(flight, "running")
        return time.monotonic() - started

    def set_position(self, flight: InFlight, position: str) -> None:
        flight.position = position
        self.changed()

    # ---- readiness --------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """This worker's readiness for the open checkpoint."""
        counts = {"in_flight": 0, "running": 0, "door": 0, "parked": 0, "replay": 0}
        blockers = []
        for flight in self.flights:
            counts["in_flight"] += 1
            counts[flight.position] += 1
            if flight.position == "running":
                blockers.append(flight.blocker())
        counts["sessions"] = len(self.store)
        return {
            "checkpoint_id": self.checkpoint_id,
            "ready": not self.is_open and not blockers,
            "blockers": sorted(blockers),
            "counts": counts,
        }

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
        task = asyncio.ensure_future(
            self.channel.send({"type": "ready", "seq": self.seq, **self.report()})
        )
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        task.add_done_callback(_ignore_closed)

    async def _poll_reports(self) -> None:
        while True:
            await asyncio.sleep(REPORT_POLL)
            self._send_report()

    def close_gate(self, checkpoint_id: str) -> None:
        self.checkpoint_id = checkpoint_id
        if self.is_open:
            self.opened.clear()
            self._poller = asyncio.ensure_future(self._poll_reports())
        self.changed()  # a worker that joins an open checkpoint reports at once

    def open_gate(self) -> None:
        self.checkpoint_id = None
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        self.opened.set()

    async def retire(self, keys: set[str]) -> int:
        """Cancel the attempts' requests, wait for them to stop, free their sessions."""
        self.retiring |= keys
        try:
            doomed = [f for f in self.flights if f.identity is not None and f.identity.key in keys]
            for flight in doomed:
                flight.retired = True
                if flight.task is not None:
                    flight.task.cancel()
            tasks = [f.task for f in doomed if f.task is not None]
            if tasks:
                await asyncio.wait(tasks)
            return self.store.release_episodes(keys) + len(doomed)
        finally:
            self.retiring -= keys


def _ignore_closed(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        with contextlib.suppress(ConnectionError):
            task.result()


async def _run_identity(request: web.Request) -> EpisodeId | None:
    """Rollout identity from a `/run` body's `_ng_rollout_id` and `_ng_attempt_index`."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("_ng_rollout_id"), str):
        return None
    attempt = body.get("_ng_attempt_index", 0)
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise GymError("invalid_request", "_ng_attempt_index must be a non-negative integer")
    return EpisodeId(body["_ng_rollout_id"], attempt)


RUNTIME = web.AppKey("gym_proxy_participant_runtime", ParticipantRuntime)


@web.middleware
async def participant_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Admission and in-flight tracking around every request of the app."""
    runtime = request.app[RUNTIME]
    try:
        flight = await runtime.admit(request)
    except GymError as exc:
        return error_response(exc)
    try:
        response = await handler(request)
        runtime.ended(request.path, response.status, flight)
        return response
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if flight.retired and task is not None and task.cancelling() == 1:
            task.uncancel()  # our own cancellation: the caller gets a clear answer
            return error_response(GymError("stale_attempt", "this attempt was retired"))
        raise
    except GymError as exc:
        return error_response(exc)
    finally:
        runtime.leave(flight)


class RequestSession:
    """The session of one request: its ID and its stored value."""

    __slots__ = ("id", "_store", "_episode")

    def __init__(self, store: SessionStore, session_id: str, episode_key: str | None) -> None:
        self.id = session_id
        self._store = store
        self._episode = episode_key

    def get(self, default: Any = None) -> Any:
        return self._store.get(self.id, default)

    def set(self, value: Any) -> None:
        self._store.put(self.id, value, self._episode)

    def delete(self) -> None:
        self._store.delete(self.id)


def current_session(request: web.Request) -> RequestSession:
    """The request's session; 400 if the request did not come through gym-proxy."""
    session_id = request.headers.get("x-ng-session-id")
    if session_id is None:
        raise GymError("invalid_request", "the request did not come through gym-proxy (no session)")
    flight: InFlight | None = request.get(_FLIGHT)
    key = flight.identity.key if flight is not None and flight.identity is not None else None
    return RequestSession(request.app[RUNTIME].store, session_id, key)


def episode(request: web.Request) -> Episode:
    """The episode context of a request that carries rollout identity."""
    flight: InFlight | None = request.get(_FLIGHT)
    if flight is None or flight.episode is None:
        detail = "this request carries no rollout identity (_ng_rollout_id)"
        raise GymError("invalid_request", detail)
    return flight.episode
