"""Every message of the coordinator channel, one typed definition used by both ends.

A message is a frozen dataclass with its wire `type` (`TYPE`). A request names the class
of its `ok` reply once, in its base: `class Close(Request[CloseReply])`. `message()` reads
it from there into `REPLY`, what the channel decodes the reply as, and the type checker
reads the same base, so `await channel.request(Close(...))` is a CloseReply to both. On
the wire a message is one JSON object (`framing`): its fields, plus `type` and, for a
request awaiting a reply, `id`. `decode` checks the object against the definition: a
missing key, an unknown key or a value of the wrong type fails with `MalformedMessage`
naming the message and the key, before a handler sees it.

    worker -> coordinator            coordinator -> worker
    register  -> RegisterReply       close      -> CloseReply (the worker's Report)
    claim     -> ClaimReply          reopen     -> Done
    ready     (no reply)             export     -> ExportReply (records, encoded)
    sessions_ended (no reply)        release    -> Released
                                     install    -> Installed
    either way                       uninstall  -> Released
    ping      -> Pong                tables     -> Done
                                     retire     -> Retired
                                     forget     -> Forgotten
                                     stop       -> Done
                                     links      -> Links
                                     move_out   -> SessionRecords
                                     move_in    -> Installed
                                     drop       -> Released
                                     held       -> HeldSessions
                                     close_tunnels -> Done
                                     stats      -> WorkerStats
                                     park_episodes -> ParkedEpisodes
                                     give_up    -> GaveUp
                                     resume_episodes -> Done
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar, get_args, get_origin

__all__ = [
    "Message",
    "Request",
    "MalformedMessage",
    "MESSAGES",
    "decode",
    "message",
    "Done",
    "Ping",
    "Pong",
    "Tables",
    "Register",
    "RegisterReply",
    "Report",
    "Ready",
    "Claim",
    "ClaimReply",
    "SessionsEnded",
    "Close",
    "CloseReply",
    "Reopen",
    "Export",
    "ExportReply",
    "Release",
    "Released",
    "Install",
    "Installed",
    "Uninstall",
    "TablesUpdate",
    "EpisodeRef",
    "Retire",
    "Retired",
    "Forget",
    "Forgotten",
    "Stop",
    "SessionRecords",
    "Links",
    "LinkedSessions",
    "MoveOut",
    "MoveIn",
    "Drop",
    "HeldSessions",
    "ListHeld",
    "CloseTunnels",
    "Stats",
    "WorkerStats",
    "RunningEpisode",
    "EPISODE_ENDED",
    "ParkEpisodes",
    "ParkedEpisodes",
    "GiveUp",
    "GaveUp",
    "ResumeEpisodes",
]

M = TypeVar("M", bound="Message")
# Covariant: a request of a narrower reply is a request of a wider one (Request[Message]
# is any request).
R = TypeVar("R", bound="Message", covariant=True)
_ENVELOPE = frozenset({"type", "id", "traceparent"})  # telemetry.TRACEPARENT


class MalformedMessage(ValueError):
    """A channel message that does not match its definition (names the message and key)."""


class Message:
    """Base of every channel message (see the module docstring)."""

    TYPE: ClassVar[str] = ""
    _checks: ClassVar[dict[str, Callable[[Any], bool]]] = {}
    _required: ClassVar[frozenset[str]] = frozenset()

    def fields(self) -> dict[str, Any]:
        """The message's fields as the wire object holds them (nested messages too)."""
        out = {}
        for name in self._checks:
            value = getattr(self, name)
            if isinstance(value, Message):
                value = value.as_json()
            elif (type(self), name) in _NESTED_LISTS:
                value = [item.as_json() for item in value]
            out[name] = value
        return out

    def wire(self) -> dict[str, Any]:
        """The whole wire object: `type` and the fields."""
        return {"type": self.TYPE, **self.fields()}

    def as_json(self) -> dict[str, Any]:
        """The message as a JSON object (an answer of the control plane: `fields`)."""
        return self.fields()

    @classmethod
    def decode(cls: type[M], payload: Mapping[str, Any], strict: bool = True) -> M:
        """The message in `payload` (envelope keys ignored), or MalformedMessage. Not
        `strict`, keys it does not define are left out, here and in what it nests (what
        another participant's answer may add), the others are checked as ever."""
        name = cls.TYPE or cls.__name__
        keys = set(payload) - _ENVELOPE
        unknown = keys - set(cls._checks)
        if unknown and strict:
            raise MalformedMessage(f"{name}: unknown key(s) {', '.join(sorted(unknown))}")
        keys -= unknown
        missing = cls._required - keys
        if missing:
            raise MalformedMessage(f"{name}: missing key(s) {', '.join(sorted(missing))}")
        values = {}
        for key in keys:
            value = payload[key]
            nested = _NESTED.get((cls, key))
            items = _NESTED_LISTS.get((cls, key))
            if nested is not None and isinstance(value, Mapping):
                value = nested.decode(value, strict)
            elif items is not None and isinstance(value, list):
                if not all(isinstance(item, Mapping) for item in value):
                    raise MalformedMessage(f"{name}: {key} is not a list of {items.__name__}")
                value = [items.decode(item, strict) for item in value]
            elif not cls._checks[key](value):
                raise MalformedMessage(f"{name}: {key} is not {_DESCRIBED[(cls, key)]}")
            values[key] = value
        return cls(**values)


class Request(Message, Generic[R]):
    """A message that gets an `ok` reply of type `R` (see the module docstring)."""

    # An instance attribute to the type checker (a ClassVar cannot hold R), a class
    # attribute at run time: `message()` sets it from the class's `Request[...]` base.
    REPLY: type[R]


MESSAGES: dict[str, type[Message]] = {}
_NESTED: dict[tuple[type[Message], str], type[Message]] = {}
_NESTED_LISTS: dict[tuple[type[Message], str], type[Message]] = {}
_DESCRIBED: dict[tuple[type[Message], str], str] = {}


@typing.dataclass_transform(frozen_default=True)  # type checkers see the dataclass it makes
def message(
    type_: str = "", registry: dict[str, type[Message]] = MESSAGES
) -> Callable[[type[M]], type[M]]:
    """Define a message class: a frozen dataclass with its checks; a `type_` registers it
    in `registry` (gym-proxy's channel's, unless a test brings its own). A request's
    reply class is the argument of its `Request[...]` base."""

    def define(cls: type[M]) -> type[M]:
        reply = _reply_of(cls)
        cls = dataclass(frozen=True, slots=True)(cls)
        hints = typing.get_type_hints(cls)
        checks, required = {}, set()
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            hint = hints[f.name]
            checks[f.name] = _check(hint)
            _DESCRIBED[(cls, f.name)] = _describe(hint)
            nested = _optional_message(hint)
            if nested is not None:
                _NESTED[(cls, f.name)] = nested
            item = get_args(hint)[0] if get_origin(hint) is list else None
            if isinstance(item, type) and issubclass(item, Message):
                _NESTED_LISTS[(cls, f.name)] = item
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.add(f.name)
        cls._checks = checks
        cls._required = frozenset(required)
        cls.TYPE = type_
        if reply is not None:
            assert issubclass(cls, Request)  # _reply_of found a Request base
            cls.REPLY = reply
        if type_:
            if type_ in registry:
                raise ValueError(f"two definitions of channel message {type_!r}")
            registry[type_] = cls
        return cls

    return define


def _optional_message(hint: Any) -> type[Message] | None:
    """The message class a field nests: `M`, or `M | None`."""
    if isinstance(hint, type) and issubclass(hint, Message):
        return hint
    if get_origin(hint) in (types.UnionType, typing.Union):
        found = [a for a in get_args(hint) if isinstance(a, type) and issubclass(a, Message)]
        if len(found) == 1 and type(None) in get_args(hint):
            return found[0]
    return None


def _reply_of(cls: type[Message]) -> type[Message] | None:
    """The reply class a request names in its `Request[...]` base (None: not a request, or
    one that inherits its parent's); TypeError for a request that names none."""
    for base in cls.__dict__.get("__orig_bases__", ()):
        origin = get_origin(base)
        if isinstance(origin, type) and issubclass(origin, Request):
            reply = get_args(base)[0]
            if not (isinstance(reply, type) and issubclass(reply, Message)):
                raise TypeError(f"{cls.__name__}: the reply of a request is a Message class")
            return reply
    if issubclass(cls, Request) and not hasattr(cls, "REPLY"):
        raise TypeError(f"{cls.__name__}: a request names its reply, as Request[TheReply]")
    return None


def decode(payload: Mapping[str, Any], registry: Mapping[str, type[Message]] = MESSAGES) -> Message:
    """The request or notice in `payload`, by its `type`; MalformedMessage if unknown."""
    kind = payload.get("type")
    cls = registry.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedMessage(f"unknown message type {kind!r}")
    return cls.decode(payload)


def _check(hint: Any) -> Callable[[Any], bool]:
    """A predicate for values of the annotation `hint` (the shapes messages use)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return lambda value: True
    if origin in (types.UnionType, typing.Union):
        alternatives = [_check(a) for a in args]
        return lambda value: any(check(value) for check in alternatives)
    if origin is Literal:
        allowed = frozenset(args)
        return lambda value: isinstance(value, str) and value in allowed
    if hint is type(None):
        return lambda value: value is None
    if hint is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return lambda value: isinstance(value, int | float) and not isinstance(value, bool)
    if hint is bytes:
        return lambda value: isinstance(value, bytes | bytearray | memoryview)
    if origin is list:
        item = _check(args[0])
        return lambda value: isinstance(value, list) and all(item(v) for v in value)
    if origin is dict:
        key, item = _check(args[0]), _check(args[1])
        return lambda value: (
            isinstance(value, dict) and all(key(k) and item(v) for k, v in value.items())
        )
    if isinstance(hint, type) and issubclass(hint, Message):
        return lambda value: isinstance(value, hint)
    if isinstance(hint, type):
        return lambda value: isinstance(value, hint)
    raise TypeError(f"channel messages cannot hold {hint!r}")


def _describe(hint: Any) -> str:
    name = getattr(hint, "__name__", None)
    return f"a {name}" if name and not get_args(hint) else f"of type {hint}"


# ---- replies and shared parts ---------------------------------------------------------
@message()
class Done(Message):
    """An `ok` reply that carries nothing."""


@message()
class Tables(Message):
    """What every worker holds of the coordinator's state: the restored rollouts not yet
    claimed (rollout -> the attempt that continues it) and the retire marks."""

    pending: dict[str, int]
    marks: dict[str, int]


@message()
class Report(Message):
    """A worker's readiness for the open checkpoint, sequenced (a later one wins)."""

    seq: int
    checkpoint_id: str | None
    ready: bool
    blockers: list[str]
    counts: dict[str, int]
    restarts: list[str]


# ---- worker -> coordinator --------------------------------------------------------------
@message()
class RegisterReply(Message):
    tables: Tables
    checkpoint_id: str | None = None  # set: a checkpoint is open; close at once


@message("register")
class Register(Request[RegisterReply]):
    """The first message on a worker's channel: which incarnation it is and what it runs."""

    slot: int
    owner: str
    pid: int
    socket: str
    kind: str
    framework: Literal["aiohttp", "asgi"]
    app_cookie: str | None
    restart_only: bool
    # A worker whose gym-proxy died, joining the one started again to adopt it
    # (`--orphan-grace`): the session IDs it holds, each with when it was last used or
    # installed (monotonic: a session two workers hold stays with the later), which the new
    # proxy's tables place on it; the retire marks it enforces, which the new coordinator
    # takes in; and the restored attempts it still expects (rollout -> attempt), which tell
    # it the unclaimed ones.
    rejoining: bool = False
    held: dict[str, float] = dataclasses.field(default_factory=dict)
    marks: dict[str, int] = dataclasses.field(default_factory=dict)
    expected: dict[str, int] = dataclasses.field(default_factory=dict)


@message("ready")
class Ready(Report):
    """A report sent whenever readiness changes (no reply)."""


@message()
class ClaimReply(Message):
    boundary: Any  # the boundary state the episode continues from


@message("claim")
class Claim(Request[ClaimReply]):
    """A worker continues a restored episode: the coordinator hands its record out once."""

    rollout_id: str
    attempt: int
    task_digest: str


@message("sessions_ended")
class SessionsEnded(Message):
    """Sessions that ended on this worker; the proxy's tables forget them (no reply)."""

    session_ids: list[str]


@message()
class Pong(Message):
    """A ping's answer: with `Ping.loop_lag`, the worst event-loop lag the peer measured
    itself since its last pong, its resident memory and the sessions it holds (0 from a
    peer that does not say)."""

    loop_lag_seconds: float = 0.0
    resident_bytes: int = 0
    sessions: int = 0  # the sessions it holds (0 from a peer that does not say)


@message("ping")
class Ping(Request[Pong]):
    """Answered by the channel's reader itself: the peer's event loop runs. `loop_lag`:
    the answer carries the peer's own loop lag (the supervisor's pings ask for it: a
    ping's round trip alone misses a stall that ends just before each ping) and its
    memory (a worker on another node has no pid the proxy can read)."""

    loop_lag: bool = False


# ---- coordinator -> worker --------------------------------------------------------------
@message()
class CloseReply(Message):
    report: Report


@message("close")
class Close(Request[CloseReply]):
    """Close admission for `checkpoint_id`; the reply is the worker's first report."""

    checkpoint_id: str


@message("reopen")
class Reopen(Request[Done]):
    """Open admission again (resume, or a rollback)."""


@message()
class ExportReply(Message):
    blob: bytes  # the records, encoded as the records file holds them
    count: int
    keys: list[str]  # capture keys of the episodes the records belong to


@message("export")
class Export(Request[ExportReply]):
    checkpoint_id: str
    scope: list[str] | None  # capture keys; None: everything
    kind: str


@message()
class Released(Message):
    released: int


@message("release")
class Release(Request[Released]):
    """After a scoped commit: drop restored state bound to episodes outside `keep`."""

    keep: list[str]


@message()
class Installed(Message):
    installed: int


@message("install")
class Install(Request[Installed]):
    """Install these restored session records (all or none): `blob` holds their lines as
    the records file `source` holds them, `numbers` their line numbers there, and
    `identities` what each must hold (`records.restored_sessions` reads and checks them)."""

    blob: bytes
    identities: list[str]
    numbers: list[int]
    source: str


@message("uninstall")
class Uninstall(Request[Released]):
    """Undo an install (a restore that failed)."""


@message("tables")
class TablesUpdate(Tables, Request[Done]):
    """Replace the worker's pending claims and merge in the marks."""


@message()
class Retired(Message):
    retired: int


@message()
class EpisodeRef(Message):
    """One rollout attempt, as `{rollout_id, attempt}`."""

    rollout_id: str
    attempt: int


@message("retire")
class Retire(Request[Retired]):
    episode_ids: list[EpisodeRef]


@message()
class Forgotten(Message):
    forgotten: list[str]


@message("forget")
class Forget(Request[Forgotten]):
    rollout_ids: list[str]


@message("proxy_stopping")
class ProxyStopping(Request[Done]):
    """gym-proxy stops for good (SIGTERM/SIGINT, not a take-over): a worker whose channel
    then ends stops too, instead of waiting `--orphan-grace` for a successor (the proxy
    may be killed before it stops the workers: NeMo Gym's launcher waits 1 s)."""


@message("stop")
class Stop(Request[Done]):
    """A commit with `stop: true` was written: free what the app can free."""


# ---- a move of live sessions (coordinator -> the source, then the target) -------------
@message()
class SessionRecords(Message):
    records: list[dict[str, Any]]  # in-memory session records (`coordinator.contract.records`)


@message()
class Links(Message):
    links: dict[str, list[str]]  # an app's session -> the gym-proxy sessions it came under


@message("links")
class LinkedSessions(Request[Links]):
    """Which gym-proxy sessions carried these app sessions' requests (a client that holds
    gym-proxy's cookie and the app's own is routed by gym-proxy's: both must move)."""

    session_ids: list[str]


@message("move_out")
class MoveOut(Request[SessionRecords]):
    """The records of those of these sessions the worker holds; it keeps serving them."""

    session_ids: list[str]


@message("move_in")
class MoveIn(Request[Installed]):
    """A move's or a hand-over's step on its target: install these live sessions (all or
    none; unlike a restore's, they are not restored state a scoped commit may release)
    and receive these `episodes`, records of parked `/run` episodes handed over: each
    continues here when its request arrives (replayed by the proxy), and counts as this
    worker's until then (a checkpoint exports it)."""

    sessions: list[dict[str, Any]]
    episodes: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@message("drop")
class Drop(Request[Released]):
    """These sessions moved away: free their state here (their requests go elsewhere);
    `episode_keys`: handed-over episodes whose request will not come (forget them)."""

    session_ids: list[str]
    episode_keys: list[str] = dataclasses.field(default_factory=list)


@message()
class RunningEpisode(Message):
    """A `/run` episode running on a worker, as an operation that empties it sees it."""

    key: str
    session_id: str | None  # the gym-proxy session its request came under
    sessions: list[str]  # the worker's sessions that move with it (its own, bound to it)
    unmovable: str  # "": it can be handed over at a boundary; else why not


@message()
class HeldSessions(Message):
    session_ids: list[str]  # every live session of the worker's store, app sessions too
    movable: bool  # False: restart-only, its sessions end where they are
    requests: int  # requests the worker is running now
    episodes: list[RunningEpisode] = dataclasses.field(default_factory=list)
    # What each session cost the worker lately (worker.session_load), seconds decayed
    # over about 3 s: the loop's delay charged to it, and its requests' running time.
    loop_delay: dict[str, float] = dataclasses.field(default_factory=dict)
    request_seconds: dict[str, float] = dataclasses.field(default_factory=dict)


@message("held")
class ListHeld(Request[HeldSessions]):
    """The sessions this worker holds (an operation that empties it moves them)."""


@message("close_tunnels")
class CloseTunnels(Request[Done]):
    """These sessions are about to move: close their WebSocket tunnels (1012) if the app's
    `tunnels` choice is "close"; with "block", a move waits for them to end."""

    session_ids: list[str]


# ---- a hand-over of parked episodes (coordinator -> the source, then the target) ----
# The reason a source gives for an episode that is not there to hand over: it ended on
# its own (answered, or its client left). Nothing is lost; a mover does not count it.
EPISODE_ENDED = "it is no longer running here (it ended, or its client left)"


@message()
class ParkedEpisodes(Message):
    episodes: list[dict[str, Any]]  # the parked episodes' records (at their boundary)
    sessions: list[dict[str, Any]]  # records of the sessions that move with them
    links: dict[str, list[str]]  # of those sessions: the gym-proxy sessions they came under
    not_parked: dict[str, str]  # episode key -> why it is not parked for a hand-over


@message("park_episodes")
class ParkEpisodes(Request[ParkedEpisodes]):
    """Park these `/run` episodes at their next boundary (or replay step), within
    `within` seconds, and answer their records; each waits there, parked, until
    `give_up` or `resume_episodes`. One that does not park in time goes on running."""

    keys: list[str]
    within: float


@message()
class GaveUp(Message):
    handed: list[str]  # episode keys whose request was answered with its hand-over marker
    kept: dict[str, str]  # episode key -> why it was not handed over (it runs or ended here)


@message("give_up")
class GiveUp(Request[GaveUp]):
    """Stop these parked episodes and answer each one's request with the hand-over
    marker carrying this id (the proxy sends the request on to the target); the sessions
    that moved with them end here."""

    handovers: dict[str, str]  # episode key -> hand-over id


@message("resume_episodes")
class ResumeEpisodes(Request[Done]):
    """A hand-over of these parked episodes was given up: they go on here."""

    keys: list[str]


@message()
class WorkerStats(Message):
    sessions: int  # live sessions in the worker's store
    requests: int  # requests it is running now
    loop_lag_seconds: float  # the worst event-loop lag since the last ask


@message("stats")
class Stats(Request[WorkerStats]):
    """What the worker knows for /metrics (the proxy knows the rest itself)."""
