"""Which worker answers a request: the routing precedence and the owner, alias and session
tables (no I/O).

`Router.route_request` is the whole order, written once; the data path (`proxy.data_path.exchange`)
hands it the request's identity headers and writes the headers its `Route` says:

1. an app's own `X-NeMo-Gym-Session-Token` (NeMo Gym's MCP token) naming a session in the
   app session table: that worker (rule `app_token`); naming none, it reaches the app
   untouched and the request goes on down this list without it;
2. this instance's token, from `X-NeMo-Gym-Session-Token`, else from this instance's
   cookie (`--cookie-name`) (rule `token`): a session the session table places (one
   that was moved) goes where it says; else
   a. naming a live owner: that worker;
   b. naming an aliased owner (old owner -> the worker that now holds its sessions);
   c. naming any other owner: 410 `session_owner_gone`;
   d. naming no owner: the session table, else placed like new work;
3. no token of this instance's, the app's own session cookie (NeMo Gym's Starlette
   session) naming a session in the app session table: that worker (rule `app_cookie`);
4. `x-ng-session-owner`: that worker (or its alias), as a new session there (rule `owner`);
5. nothing: a new session on the live, responsive worker with the fewest requests in
   flight, ties broken round-robin (rule `new`); a worker not answering the supervisor's
   pings gets no new sessions, nor does one an operation is draining; one whose event
   loop stalls (`--rebalance`) gets them only when every other does too.

**Identity comes only from a verified token.** There are two session tables, and nothing
crosses between them:

- `sessions`, gym-proxy's own sessions the table places (moved, restored without an
  owner, or an ownerless token placed on first use). Only rule 2 reads it, so only a
  token this instance signed reaches one, and only such a route carries a gym-proxy
  session (`x-ng-session-id`) to the worker;
- `app_sessions`, the app's own sessions (NeMo Gym's Starlette session and MCP token
  session IDs) that workers announced, moves placed or a restore placed. Only rules 1
  and 3 read it. Those carry values a client writes and the proxy cannot verify (the
  secret is the app's), so they only pick the worker: the request carries the claimed
  ID as `x-ng-app-session-claim`, never as a gym-proxy session, and the app verifies its
  own token or cookie.

Which table a worker's session IDs belong in (its records, the sessions it ends) follows
what the workers keep: the app's own session IDs when the app has its own session
cookie (`app_cookie`, registered by the workers), else gym-proxy's (`Router.kept`).

A token that is not this instance's (another server's, or the app's own) is taken as
absent.

**Copies.** Every copy of this instance's token a request carries must verify, whichever
carrier it is in: each `X-NeMo-Gym-Session-Token` header and each cookie of this
instance's name (`invalid_session_token` otherwise). Within one carrier every copy must
name the same session (two headers, or two cookies, that disagree are refused: nothing
tells which one the client meant); across carriers the header wins over the cookie.

Only a new session gets a token. An existing session keeps its token for life, even
when an alias or the session table routes it: a client that keeps an old cookie must
still be routable after a second crash and a restore of the same checkpoint, which
only knows the owners of its own time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from gym_proxy.coordinator.contract.app_sessions import app_token_session, session_in_headers
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.ids import is_valid_id
from gym_proxy.proxy.data_path.http_wire import cookie_values
from gym_proxy.proxy.data_path.session_tokens import (
    SessionIdentity,
    TokenCodec,
    TokenError,
    new_session_id,
)

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "WORKER_WATCH",
    "worker_watch",
    "WorkerRoute",
    "ExpectedHandover",
    "Route",
    "Router",
    "APP_TOKEN",
    "TOKEN",
    "APP_COOKIE",
    "OWNER",
    "NEW",
    "RULES",
]

# The rule that decided a Route (module docstring).
APP_TOKEN: Final = "app_token"
TOKEN: Final = "token"
APP_COOKIE: Final = "app_cookie"
OWNER: Final = "owner"
NEW: Final = "new"
RULES: Final = (APP_TOKEN, TOKEN, APP_COOKIE, OWNER, NEW)


@dataclass(slots=True, eq=False)
class WorkerRoute:
    """A live worker as the data path sees it. `pool` belongs to the I/O layer."""

    owner: str
    slot: int
    address: str  # its Unix socket path, or tcp://host:port on another node
    in_flight: int = 0
    pool: Any = None
    responsive: bool = True  # False while the supervisor's pings go unanswered
    # Its event loop stalls (`proxy.fleet.balance.rebalance`): new sessions go elsewhere while
    # any other worker takes them.
    stalled: bool = False
    keeps_rollout_prefix: bool = False  # ASGI apps see /ng-rollout/<key>/ as sent
    draining: bool = False  # an operation empties it: no new sessions go to it
    # Requests routed to it that wait at the proxy while an operation takes it out of
    # service (None: none wait); they are started again, and routed anew, after.
    held: list[Any] | None = None
    served: int = 0  # requests routed to it, for --max-requests
    # Its answers by status class (index status // 100: 1xx ... 5xx), for /metrics.
    responses: list[int] = field(default_factory=lambda: [0] * 6)


class ExpectedHandover:
    """A request the mover expects `source` to give back (its episode handed over, in
    `worker.handovers`): the data path sends it on to `target`, and `settle` tells the
    mover how that went ("" once it is on its way to the target, else why not)."""

    __slots__ = ("source", "target", "arrived")

    def __init__(
        self, source: WorkerRoute, target: WorkerRoute, arrived: asyncio.Future[str]
    ) -> None:
        self.source = source
        self.target = target
        self.arrived = arrived  # resolved once

    def settle(self, why_not: str) -> None:
        if not self.arrived.done():
            self.arrived.set_result(why_not)


class Route:
    """The decision for one request, and the rule that made it. `new`: the session ID was
    minted for this request, so the client gets a token; an existing session keeps the
    token it has (`token`, as the request carried it; `cookie`: the name of this
    instance's cookie when that routed it, None otherwise). (A plain class, not a
    dataclass: one is made per request, and mypyc compiles this __init__, where a
    dataclass's runs as Python.)"""

    __slots__ = ("worker", "session_id", "new", "rule", "token", "cookie")

    def __init__(self, worker: WorkerRoute, session_id: str, new: bool, rule: str = NEW) -> None:
        self.worker = worker
        self.session_id = session_id
        self.new = new
        self.rule = rule
        self.token: bytes | None = None
        self.cookie: bytes | None = None


def _gone(owner: str) -> GymError:
    detail = f"the worker that held this session ({owner}) is gone"
    return GymError("session_owner_gone", detail)


# A worker's key in `Router.watchers`: the prefix and its owner ID. The space keeps it
# apart from every session ID (`coordinator.contract.ids`).
WORKER_WATCH: Final = "worker "


def worker_watch(owner: str) -> str:
    """The key under which a wait is woken by the end of any request of worker `owner`."""
    return WORKER_WATCH + owner


@dataclass
class Router:
    """The routing tables. The I/O layer adds and removes workers as they come and go."""

    workers: dict[str, WorkerRoute] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    # The two session tables (module docstring): gym-proxy's sessions, reached only by a
    # verified token, and the app's own, reached only by the app's token or cookie.
    sessions: dict[str, str] = field(default_factory=dict)
    app_sessions: dict[str, str] = field(default_factory=dict)
    app_cookie: bytes | None = None  # the app's own session cookie (workers say it)
    # Requests routed and not yet done, per session (a move waits for none), and the
    # requests held while their session moves (exchanges, started again after the move).
    active: dict[str, int] = field(default_factory=dict)
    holding: dict[str, list[Any]] = field(default_factory=dict)
    # Who waits for a request of a session to end (a move, a hand-over: futures the
    # data path resolves as one ends; `proxy.fleet.moves.session_watch`), by session.
    watchers: dict[str, list[asyncio.Future[None]]] = field(default_factory=dict)
    # Hand-over id (the marker a worker answers with) -> the hand-over the mover expects.
    handovers: dict[bytes, ExpectedHandover] = field(default_factory=dict)
    # Called with the alias table after it changed (the fleet keeps it for a successor:
    # `proxy.fleet.supervision.intent.KeptIntent`).
    on_aliases: Callable[[dict[str, str]], None] | None = None
    # Counted for /metrics: decisions by rule, and foreign tokens passed to the app.
    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    foreign_tokens: int = 0
    _live: list[WorkerRoute] = field(default_factory=list)
    _next: int = 0

    def add_worker(self, worker: WorkerRoute) -> None:
        """Make `worker` routable."""
        self.workers[worker.owner] = worker
        self._live = sorted(self.workers.values(), key=lambda w: w.slot)

    def remove_worker(self, owner: str) -> WorkerRoute | None:
        """Stop routing to `owner`; tokens naming it now answer 410."""
        worker = self.workers.pop(owner, None)
        self._live = sorted(self.workers.values(), key=lambda w: w.slot)
        return worker

    @property
    def kept(self) -> dict[str, str]:
        """The table of the session IDs the workers keep (their records, the sessions
        they end): the app's own when the app has its own session cookie, else
        gym-proxy's (module docstring)."""
        return self.app_sessions if self.app_cookie is not None else self.sessions

    def set_tables(
        self,
        aliases: dict[str, str],
        sessions: dict[str, str],
        app_sessions: dict[str, str] | None = None,
    ) -> None:
        """Replace the alias and session tables (restore pushes them)."""
        self.aliases = dict(aliases)
        self.sessions = dict(sessions)
        self.app_sessions = dict(app_sessions or {})
        self._aliases_changed()

    def forget_sessions(self, owner: str, session_ids: list[str]) -> None:
        """`owner`'s worker ended these sessions: drop those the table sends to it."""
        sessions, aliases = self.kept, self.aliases
        for session_id in session_ids:
            holder = sessions.get(session_id)
            if holder is not None and (holder == owner or aliases.get(holder) == owner):
                del sessions[session_id]

    def inherit_owner(self, old: str, heir: str) -> None:
        """An operation stopped `old`'s worker after moving its sessions: whatever still
        names it (a cookie of a session it kept no state for, an alias, a placed session)
        goes to `heir` from now on."""
        aliases = self.aliases
        for owner, target in aliases.items():
            if target == old:
                aliases[owner] = heir
        aliases[old] = heir
        for table in (self.sessions, self.app_sessions):
            for session_id, holder in table.items():
                if holder == old:
                    table[session_id] = heir
        self._aliases_changed()

    @property
    def keeps_app_sessions(self) -> bool:
        """The workers key their sessions (and records) by the app's own session IDs."""
        return self.app_cookie is not None

    def _aliases_changed(self) -> None:
        if self.on_aliases is not None:
            self.on_aliases(self.aliases)

    def resolve_owner(self, owner: str) -> WorkerRoute | None:
        """The live worker that holds `owner`'s sessions, directly or through an alias."""
        worker = self.workers.get(owner)
        if worker is not None:
            return worker
        target = self.aliases.get(owner)
        return self.workers.get(target) if target is not None else None

    def least_loaded(self) -> WorkerRoute:
        """The responsive worker with the fewest requests in flight, a stalled one only
        when every one is; ties go round-robin."""
        live = self._live
        count = len(live)
        start = self._next % count if count else 0
        self._next = start + 1
        best = None
        best_stalled = None
        for i in range(count):
            candidate = live[(start + i) % count]
            if not candidate.responsive or candidate.draining:
                continue
            if candidate.stalled:
                if best_stalled is None or candidate.in_flight < best_stalled.in_flight:
                    best_stalled = candidate
            elif best is None or candidate.in_flight < best.in_flight:
                best = candidate
        if best is None:
            best = best_stalled
        if best is None:
            raise GymError(
                "worker_unavailable", "no worker is live and taking sessions; retry shortly"
            )
        return best

    def route_request(
        self,
        codec: TokenCodec,
        cookie_name: bytes,
        token: bytes | None,
        cookie: bytes | None,
        owner_hint: bytes | None,
        app_token: bytes | None = None,
    ) -> Route:
        """Where one request goes, by the precedence in the module docstring: `token` is
        `X-NeMo-Gym-Session-Token` when it is this instance's, `app_token` when it is not,
        `cookie` the Cookie header, `owner_hint` `x-ng-session-owner`. Raises TokenError
        for a malformed token of this instance's or owner hint, GymError when the request
        may go nowhere."""
        owner = None
        if owner_hint is not None:
            owner = owner_hint.decode("latin-1")
            if not is_valid_id(owner):
                raise TokenError("x-ng-session-owner is not a valid owner ID")
        # Every copy of this instance's token is checked before any rule is applied: a
        # damaged one is refused whatever else the request carries (module docstring).
        identity = codec.read_bytes(token) if token is not None else None
        from_cookie = None
        if cookie is not None:
            from_cookie = self._cookie_identity(codec, cookie, cookie_name)
        if app_token is not None:
            app_session = app_token_session(app_token)
            if app_session is not None:
                route = self.route_app_session(app_session, APP_TOKEN)
                if route is not None:
                    return route
            self.foreign_tokens += 1  # it reaches the app untouched
        by_cookie = False
        if identity is None and from_cookie is not None:
            identity, token = from_cookie  # the header, when it has one, wins
            by_cookie = True
        if identity is not None:
            route = self.route(identity, owner)
            route.token = token
            if by_cookie:  # only a cookie that routed is set again
                route.cookie = cookie_name
            return route
        if cookie is not None and self.app_sessions:
            cookie_session = session_in_headers([(b"cookie", cookie)], False, self.app_cookie)
            if cookie_session is not None:
                route = self.route_app_session(cookie_session, APP_COOKIE)
                if route is not None:
                    return route
        return self.route(None, owner)

    @staticmethod
    def _cookie_identity(
        codec: TokenCodec, cookie: bytes, cookie_name: bytes
    ) -> tuple[SessionIdentity, bytes] | None:
        """The identity this instance's cookie names, with its token; every copy must
        verify and name one session (module docstring)."""
        found: tuple[SessionIdentity, bytes] | None = None
        for value in cookie_values(cookie, cookie_name):
            identity = codec.read_bytes(value)
            if identity is None:
                continue  # not this instance's: the app's, or another server's
            if found is not None and found[0].session_id != identity.session_id:
                raise TokenError("two session cookies of this instance name different sessions")
            found = (identity, value)
        return found

    def route_app_session(self, session_id: str, rule: str = APP_TOKEN) -> Route | None:
        """Where an app's own session goes: the worker its table names (None when it
        names none; the proxy never remembers a session it learned from a client)."""
        holder = self.app_sessions.get(session_id)
        if holder is None:
            return None
        worker = self.resolve_owner(holder)
        if worker is None:
            raise _gone(holder)
        return Route(worker, session_id, False, rule)

    def route(self, identity: SessionIdentity | None, owner_hint: str | None) -> Route:
        """Rules 2, 4 and 5 of the module docstring: `identity` is what this instance's
        token says (None: no token); raise GymError when the request may go nowhere."""
        if identity is not None:
            owner = identity.owner
            if owner is not None and identity.session_id not in self.sessions:
                worker = self.workers.get(owner)
                if worker is not None:
                    return Route(worker, identity.session_id, False, TOKEN)
                worker = self.resolve_owner(owner)
                if worker is None:
                    raise _gone(owner)
                return Route(worker, identity.session_id, False, TOKEN)
            placed = self.sessions.get(identity.session_id)
            if placed is not None:
                worker = self.resolve_owner(placed)
                if worker is None:
                    raise _gone(placed)
            else:
                worker = self.least_loaded()
                self.sessions[identity.session_id] = worker.owner
            return Route(worker, identity.session_id, False, TOKEN)
        if owner_hint is not None:
            worker = self.resolve_owner(owner_hint)
            if worker is None:
                raise GymError("session_owner_gone", f"owner {owner_hint} is not live")
            return Route(worker, new_session_id(), True, OWNER)
        return Route(self.least_loaded(), new_session_id(), True, NEW)
