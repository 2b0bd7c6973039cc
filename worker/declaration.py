"""An app's declaration (`Participation`): how it takes part in checkpoints, its kind,
and where its session state lives.

Four ways, as in NeMo Gym:

- **the session store** (the default for aiohttp apps): the app keeps per-session state
  through `current_session(request).set(...)`; the runtime exports and installs it;
- **a session dict**: the app keeps its state in a dict keyed by its own session IDs, as
  NeMo Gym servers do, and declares it (`session_state=server.session_id_to_counter`;
  `worker.session_dicts`): no code;
- **hooks**: the app keeps its state itself and hands the runtime async callables;
- **restart-only** (the default for an ASGI app that declares nothing): it never blocks
  a checkpoint, exports nothing, and reports the episodes of its live sessions under
  `report.restarts`, so the controller starts those rollouts over.

An app whose `/run` episodes never call `ep.boundary` declares `episode_boundaries=False`
(NeMo Gym's servers do, through `worker.nemo_gym_server`): an operation that empties a
worker then does not wait for a boundary to hand an episode over; it waits for the
episode to end.

A WebSocket (any upgraded connection) is a *tunnel*: it cannot park at a boundary, so
`tunnels` says what a checkpoint does with one: `"close"` (the default) closes it when
the checkpoint closes admission (WebSocket close code 1012, "service restart"; the
client reconnects and waits at the door until resume), `"block"` names it as a blocker
(`tunnel:<session>`) until the client closes it.

An app declares itself with `declare(app, Participation(...))`: on an aiohttp
Application it is stored under an `AppKey` (`PARTICIPATION`), on any ASGI app as the
attribute `gym_proxy_participation`. `gym-proxy --kind` overrides the kind. The front
doors and the runtime read the declaration; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar, get_args

from aiohttp import web

from gym_proxy.worker.session_dicts import SessionDict

__all__ = [
    "KINDS",
    "PARTICIPATION",
    "TUNNEL_POLICIES",
    "ParticipantHooks",
    "Participation",
    "declare",
    "declared",
]

Kind = Literal["resources", "agent", "environment", "model"]
TunnelPolicy = Literal["close", "block"]
KINDS: tuple[Kind, ...] = get_args(Kind)
TUNNEL_POLICIES: tuple[TunnelPolicy, ...] = get_args(TunnelPolicy)
_ATTRIBUTE = "gym_proxy_participation"
App = TypeVar("App")  # an aiohttp Application or an ASGI app, handed back as it came

SessionStates = dict[str, Any]


@dataclass(frozen=True)
class ParticipantHooks:
    """Callables for an app that keeps session state itself. Session IDs are the ones the
    runtime tracks for the app (the app's own, for an app with a Starlette session).

    - `export(session_ids) -> {session_id: state}`: the JSON-able state of these live
      sessions, all at once (a session the app already dropped is simply left out);
    - `restore({session_id: state})`: install all of them, or raise and install none;
    - `retire(session_ids)`: drop these sessions' state (a retired attempt, restored state a
      commit left out, a failed restore); must tolerate repeats and unknown IDs;
    - `stop()`: a commit with `stop: true` was written; free what can be freed;
    - `release(session_ids)`: these sessions ended (a 2xx `/close_session`, a resources
      `/verify`, the idle TTL): drop their state; called at once, so it is not async.
    """

    export: Callable[[list[str]], Awaitable[SessionStates]] | None = None
    restore: Callable[[SessionStates], Awaitable[None]] | None = None
    retire: Callable[[list[str]], Awaitable[None]] | None = None
    stop: Callable[[], Awaitable[None]] | None = None
    release: Callable[[list[str]], None] | None = None


@dataclass(frozen=True)
class Participation:
    """An app's declaration: its kind, and hooks or restart-only (else the session store)."""

    kind: Kind = "resources"
    hooks: ParticipantHooks | None = None
    restart_only: bool = False
    tunnels: TunnelPolicy = "close"  # what a checkpoint does with an open WebSocket
    # A dict of the app's holding each session's state (keyed by the app's session IDs);
    # declaring it stands for hooks (`worker.session_dicts`).
    session_state: MutableMapping[str, Any] | None = None
    # Its `/run` episodes mark boundaries (`ep.boundary`), where an operation that empties
    # a worker can hand one over (`worker.handovers`); False: they run where they are
    # (NeMo Gym's own servers know nothing of gym-proxy's episode API).
    episode_boundaries: bool = True

    def __post_init__(self) -> None:
        if self.session_state is not None:
            if self.hooks is not None or self.restart_only:
                raise ValueError("session_state stands for hooks: declare one, not both")
            if not isinstance(self.session_state, MutableMapping):
                kind = type(self.session_state).__name__
                raise ValueError(f"session_state must be a dict keyed by session ID, not {kind}")
            states = SessionDict(self.session_state)
            hooks = ParticipantHooks(
                export=states.export,
                restore=states.restore,
                retire=states.retire,
                release=states.drop,
            )
            object.__setattr__(self, "hooks", hooks)
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.tunnels not in TUNNEL_POLICIES:
            raise ValueError(f"tunnels must be 'close' or 'block', not {self.tunnels!r}")
        if self.restart_only and self.hooks is not None:
            raise ValueError("a restart-only participant has no hooks")

    def with_kind(self, kind: str | None) -> Participation:
        """As `kind` (gym-proxy's `--kind`), or as declared (None); ValueError for a kind
        not in KINDS."""
        if kind is None:
            return self
        chosen = next((k for k in KINDS if k == kind), None)
        if chosen is None:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        if self.session_state is not None:  # its hooks are derived again
            return replace(self, kind=chosen, hooks=None)
        return replace(self, kind=chosen)


PARTICIPATION = web.AppKey("gym_proxy_participation", Participation)


def declare(app: App, participation: Participation) -> App:
    """Attach `participation` to an aiohttp Application or an ASGI app; return the app."""
    if isinstance(app, web.Application):
        app[PARTICIPATION] = participation
    else:
        setattr(app, _ATTRIBUTE, participation)
    return app


def declared(app: Any) -> Participation | None:
    """The participation an ASGI app declared, if any."""
    return getattr(app, _ATTRIBUTE, None)
