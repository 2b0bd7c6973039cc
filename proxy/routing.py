"""Which worker answers a request: the owner, alias and session tables (no I/O).

The data path (`proxy.exchange`) first looks for an app's own token naming a session a
worker announced (`route_app_session`), then for this instance's token (header, then its
cookie; `proxy.session_tokens`), and calls `route` with what it found:

1. a token naming a live owner: that worker;
2. a token naming an aliased owner (old owner -> the worker that now holds its sessions);
3. a token naming any other owner: 410 `session_owner_gone`;
4. a token naming no owner: the session table, else placed like new work;
5. no token, `x-ng-session-owner`: that worker (or its alias), as a new session there;
6. nothing: a new session on the live, responsive worker with the fewest requests in
   flight (ties broken round-robin); a worker not answering the supervisor's pings gets
   no new sessions.

A legacy token (minted before tokens named their instance) is this instance's only when it
names an owner this instance has had, or one its restored checkpoint aliased (or, without
an owner, a session of the session table); any other is taken as absent: with a secret
shared between instances, it may be another instance's.

Only a new session gets a token. An existing session keeps its token for life, even
when an alias or the session table routes it: a client that keeps an old cookie must
still be routable after a second crash and a restore of the same checkpoint, which
only knows the owners of its own time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import GymError
from proxy.session_tokens import SessionIdentity, new_session_id

__all__ = ["WorkerRoute", "Route", "Router"]


@dataclass(slots=True, eq=False)
class WorkerRoute:
    """A live worker as the data path sees it. `pool` belongs to the I/O layer."""

    owner: str
    slot: int
    socket_path: str
    in_flight: int = 0
    pool: Any = None
    responsive: bool = True  # False while the supervisor's pings go unanswered
    keeps_rollout_prefix: bool = False  # ASGI apps see /ng-rollout/<key>/ as sent


@dataclass(slots=True)
class Route:
    """The decision for one request. `new`: the session ID was minted for this request,
    so the client gets a token; an existing session keeps the token it has."""

    worker: WorkerRoute
    session_id: str
    new: bool


def _gone(owner: str) -> GymError:
    detail = f"the worker that held this session ({owner}) is gone"
    return GymError("session_owner_gone", detail)


@dataclass
class Router:
    """The routing tables. The I/O layer adds and removes workers as they come and go."""

    workers: dict[str, WorkerRoute] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    sessions: dict[str, str] = field(default_factory=dict)
    # Every owner this process has had a worker for (a few per slot and restart).
    past_owners: set[str] = field(default_factory=set)
    app_cookie: bytes | None = None  # the app's own session cookie (workers say it)
    _live: list[WorkerRoute] = field(default_factory=list)
    _next: int = 0

    def add_worker(self, worker: WorkerRoute) -> None:
        """Make `worker` routable."""
        self.workers[worker.owner] = worker
        self.past_owners.add(worker.owner)
        self._live = sorted(self.workers.values(), key=lambda w: w.slot)

    def remove_worker(self, owner: str) -> WorkerRoute | None:
        """Stop routing to `owner`; tokens naming it now answer 410."""
        worker = self.workers.pop(owner, None)
        self._live = sorted(self.workers.values(), key=lambda w: w.slot)
        return worker

    def set_tables(self, aliases: dict[str, str], sessions: dict[str, str]) -> None:
        """Replace the alias and session tables (restore pushes them)."""
        self.aliases = dict(aliases)
        self.sessions = dict(sessions)

    def forget_sessions(self, owner: str, session_ids: list[str]) -> None:
        """`owner`'s worker ended these sessions: drop those the table sends to it."""
        sessions, aliases = self.sessions, self.aliases
        for session_id in session_ids:
            holder = sessions.get(session_id)
            if holder is not None and (holder == owner or aliases.get(holder) == owner):
                del sessions[session_id]

    def resolve_owner(self, owner: str) -> WorkerRoute | None:
        """The live worker that holds `owner`'s sessions, directly or through an alias."""
        worker = self.workers.get(owner)
        if worker is not None:
            return worker
        target = self.aliases.get(owner)
        return self.workers.get(target) if target is not None else None

    def least_loaded(self) -> WorkerRoute:
        """The responsive worker with the fewest requests in flight; ties go round-robin."""
        live = self._live
        count = len(live)
        start = self._next % count if count else 0
        self._next = start + 1
        best = None
        for i in range(count):
            candidate = live[(start + i) % count]
            if candidate.responsive and (best is None or candidate.in_flight < best.in_flight):
                best = candidate
        if best is None:
            raise GymError("worker_unavailable", "no worker is live and answering; retry shortly")
        return best

    def route_app_session(self, session_id: str) -> Route | None:
        """Where an app's own token goes: the worker that announced its session (None when
        no worker did; such a token is never remembered)."""
        holder = self.sessions.get(session_id)
        if holder is None:
            return None
        worker = self.resolve_owner(holder)
        if worker is None:
            raise _gone(holder)
        return Route(worker, session_id, False)

    def knows(self, identity: SessionIdentity) -> bool:
        """Whether a legacy token names something of this instance (module docstring)."""
        owner = identity.owner
        if owner is None:
            return identity.session_id in self.sessions
        return owner in self.past_owners or owner in self.aliases

    def route(self, identity: SessionIdentity | None, owner_hint: str | None) -> Route:
        """Decide where one request goes; raise GymError when it may go nowhere."""
        if identity is not None and identity.legacy and not self.knows(identity):
            identity = None
        if identity is not None:
            owner = identity.owner
            if owner is not None:
                worker = self.workers.get(owner)
                if worker is not None:
                    return Route(worker, identity.session_id, False)
                worker = self.resolve_owner(owner)
                if worker is None:
                    raise _gone(owner)
                return Route(worker, identity.session_id, False)
            placed = self.sessions.get(identity.session_id)
            if placed is not None:
                worker = self.resolve_owner(placed)
                if worker is None:
                    raise _gone(placed)
            else:
                worker = self.least_loaded()
                self.sessions[identity.session_id] = worker.owner
            return Route(worker, identity.session_id, False)
        if owner_hint is not None:
            worker = self.resolve_owner(owner_hint)
            if worker is None:
                raise GymError("session_owner_gone", f"owner {owner_hint} is not live")
            return Route(worker, new_session_id(), True)
        return Route(self.least_loaded(), new_session_id(), True)
