"""A request in a worker as the participant runtime tracks it: what admission is told
of it (`RequestFacts`, from whichever front door), and the record of it while it is in
flight (`InFlight`: what it is and where it stands)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from gym_proxy.coordinator.contract.episodes import EpisodeId

if TYPE_CHECKING:
    from gym_proxy.worker.episodes import Episode
    from gym_proxy.worker.handovers import EpisodeHandover

__all__ = ["Position", "RequestFacts", "InFlight", "own_cancellation"]

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
