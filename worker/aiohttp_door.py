"""The participant runtime's front door for aiohttp apps: one middleware, outermost.

aiohttp routes a request before any middleware runs, so for these workers the proxy
strips `/ng-rollout/<key>/` and passes the key as `x-ng-episode-key`. A handler that
prepares a `WebSocketResponse` turns its request into a tunnel (`on_response_prepare`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import hdrs, web

from gym_proxy.coordinator.contract import headers as names
from gym_proxy.coordinator.contract.errors import RETRY_AFTER, GymError
from gym_proxy.worker.declaration import PARTICIPATION, Kind, Participation
from gym_proxy.worker.flights import RequestFacts, own_cancellation
from gym_proxy.worker.runtime import ParticipantRuntime

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

    from gym_proxy.worker.handovers import EpisodeHandover

__all__ = [
    "PARTICIPANT_KIND",
    "RUNTIME",
    "FLIGHT",
    "error_response",
    "install_door",
    "participant_middleware",
    "participation_of",
]

PARTICIPANT_KIND = web.AppKey[Kind]("gym_proxy_participant_kind")
RUNTIME = web.AppKey("gym_proxy_participant_runtime", ParticipantRuntime)
# A request key (aiohttp >= 3.13 warns at a plain string one), or the string on an
# older aiohttp.
FLIGHT: Any = (
    web.RequestKey("gym_proxy_flight", object) if hasattr(web, "RequestKey") else "gym_proxy.flight"
)
# Names as aiohttp's headers take them. Only an app's own token reaches a worker.
_SESSION_ID = names.text(names.SESSION_ID)
_SESSION_NEW = names.text(names.SESSION_NEW)
_EPISODE_KEY = names.text(names.EPISODE_KEY)
_APP_TOKEN = names.text(names.APP_TOKEN)
_APP_SESSION_CLAIM = names.text(names.APP_SESSION_CLAIM)


def participation_of(app: web.Application) -> Participation:
    """What the app declared (`declare`, or the older `app[PARTICIPANT_KIND]`)."""
    declared = app.get(PARTICIPATION)
    if declared is not None:
        return declared
    return Participation(kind=app.get(PARTICIPANT_KIND, "resources"))


def error_response(error: GymError) -> web.Response:
    """The JSON answer to a refusal (status and Retry-After from the one table)."""
    return web.Response(
        status=error.status,
        body=error.body(),
        content_type="application/json",
        headers={"Retry-After": "1"} if error.code in RETRY_AFTER else None,
    )


def install_door(app: web.Application) -> None:
    """Put the runtime's door in front of `app` (before the app is frozen)."""
    # Outermost, so admission decides before any app middleware runs.
    app.middlewares.insert(0, participant_middleware)
    app.on_response_prepare.append(_note_tunnel)


async def _note_tunnel(request: web.Request, response: web.StreamResponse) -> None:
    flight = request.get(FLIGHT)
    if flight is not None:
        flight.responding = True
    if flight is not None and isinstance(response, web.WebSocketResponse):

        def close() -> None:
            # 1012 "service restart": the client reconnects (and waits at the door).
            asyncio.ensure_future(response.close(code=1012, message=b"checkpoint"))

        request.app[RUNTIME].tunnel_opened(flight, close)


async def _handover_marker(
    request: web.Request, handover: EpisodeHandover, handover_id: str
) -> web.Response:
    """The answer that gives the request back to the proxy (worker.handovers): the
    marker and the request's own body, read again (aiohttp keeps what it read)."""
    body = await request.read()
    handover.sent = True
    marker = {names.text(names.HANDOVER_HEADER): handover_id}
    return web.Response(status=names.HANDOVER_STATUS, body=body, headers=marker)


@web.middleware
async def participant_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Admission and in-flight tracking around every request of the app."""
    runtime = request.app[RUNTIME]
    headers = request.headers
    facts = RequestFacts(
        request.method,
        request.path,
        headers.get(_SESSION_ID),
        headers.get(_SESSION_NEW) == "1",
        headers.get(_EPISODE_KEY),
        _APP_TOKEN in headers,
        headers.get(_APP_SESSION_CLAIM),
    )
    try:
        flight = await runtime.admit(facts, request.read)
    except GymError as exc:
        return error_response(exc)
    request[FLIGHT] = flight
    flight.replayable = hdrs.CONTENT_ENCODING not in headers  # aiohttp decodes such a body
    try:
        response = await handler(request)
        runtime.answered(flight, response.status)
        await runtime.hold_answer(flight)
        return response
    except asyncio.CancelledError:
        if own_cancellation(flight):
            if flight.handover is not None and flight.handover.id is not None:
                return await _handover_marker(request, flight.handover, flight.handover.id)
            return error_response(GymError("stale_attempt", "this attempt was retired"))
        raise
    except GymError as exc:
        return error_response(exc)
    finally:
        runtime.leave(flight)
