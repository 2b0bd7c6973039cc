"""What an app author uses of the participant runtime, for aiohttp and ASGI apps alike.

    from gym_proxy.worker.participant import current_session, episode

    session = current_session(request)   # aiohttp Request, Starlette Request, or ASGI scope
    session.set(session.get(0) + 1)      # JSON-able; exported at commit
    ep = episode(request)                # a request under rollout identity
    await ep.boundary(state)

In an ASGI app the same context is `scope["gym_proxy"]` (a `RequestContext`): its
`session`, `episode`, `kind` and `worker`. Declaring the kind, hooks or restart-only:
`gym_proxy.worker.declaration.declare` (also importable from here).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.worker.aiohttp_door import FLIGHT, PARTICIPANT_KIND, RUNTIME
from gym_proxy.worker.asgi_door import SCOPE_KEY
from gym_proxy.worker.declaration import PARTICIPATION, ParticipantHooks, Participation, declare
from gym_proxy.worker.episodes import Episode
from gym_proxy.worker.request_context import RequestContext, RequestSession

__all__ = [
    "PARTICIPANT_KIND",
    "PARTICIPATION",
    "RUNTIME",
    "ParticipantHooks",
    "Participation",
    "RequestContext",
    "RequestSession",
    "context",
    "current_session",
    "declare",
    "episode",
]


def context(request: Any) -> RequestContext:
    """The runtime's view of `request`: an aiohttp Request, a Starlette Request (anything
    with `.scope`) or an ASGI scope."""
    if isinstance(request, web.Request):
        flight = request.get(FLIGHT)
        if flight is not None:
            return RequestContext(request.app[RUNTIME], flight)
    else:
        scope = getattr(request, "scope", request)
        found: RequestContext | None = scope.get(SCOPE_KEY) if isinstance(scope, dict) else None
        if found is not None:
            return found
    raise GymError("invalid_request", "the request did not pass the participant runtime")


def current_session(request: Any) -> RequestSession:
    """The request's session; 400 `invalid_request` if it did not come through gym-proxy."""
    return context(request).session


def episode(request: Any) -> Episode:
    """The episode context of a request that carries rollout identity."""
    return context(request).episode
