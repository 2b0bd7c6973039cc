"""The participant runtime's front door for ASGI apps: pure ASGI, outermost.

Bodies stream through untouched, with one exception: a `POST /run` or `/seed_session`
body is read ahead (and handed to the app unchanged) because the rollout identity is in
it, as NeMo Gym's own middleware does. The path reaches the app as the client sent it,
`/ng-rollout/<key>/` included (NeMo Gym apps strip it themselves); the runtime still
learns the key.

An app with a Starlette session (NeMo Gym's SessionMiddleware keeps `session_id` in it)
is tracked by its own session ID (`ParticipantRuntime.app_keyed`), read from the session
cookie its answer sets (`worker.app_sessions`; the app signed it, while the cookie a
request carries is the client's word): a 2xx `/seed_session` starts tracking it, and its
response carries `x-ng-app-session: <id>`, which the proxy strips and records, so MCP
calls that carry only the app's token route to this worker; the answer that ends it (a
2xx `/verify` on resources, or `/close_session`) carries `x-ng-app-session-end: <id>`. A
request the proxy routed by the app's token or cookie arrives with the session it claims
in `x-ng-app-session-claim` and no gym-proxy session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gym_proxy.coordinator.contract.app_sessions import session_in_headers
from gym_proxy.coordinator.contract.errors import RETRY_AFTER, GymError
from gym_proxy.coordinator.contract.headers import (
    APP_SESSION,
    APP_SESSION_CLAIM,
    APP_SESSION_END,
    APP_TOKEN,
    HANDOVER_HEADER,
    HANDOVER_STATUS,
    SESSION_ID,
    SESSION_NEW,
    split_rollout_path,
)
from gym_proxy.worker.app_sessions import app_session_cookie, starlette_app
from gym_proxy.worker.flights import InFlight, RequestFacts, own_cancellation
from gym_proxy.worker.handovers import hands_over
from gym_proxy.worker.request_context import RequestContext
from gym_proxy.worker.runtime import RUN_BODY_LIMIT, ParticipantRuntime

__all__ = [
    "AsgiDoor",
    "RequestCycle",
    "TunnelCycle",
    "SCOPE_KEY",
    "answer_runtime_errors",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SCOPE_KEY = (
    "gym_proxy"  # scope[SCOPE_KEY] is the request's gym_proxy.worker.participant.RequestContext
)


class AsgiDoor:
    """Wraps an ASGI app with admission and in-flight tracking: each HTTP request goes
    through it as a `RequestCycle`, each WebSocket as a `TunnelCycle`."""

    def __init__(self, app: Any, runtime: ParticipantRuntime) -> None:
        self.app = app
        self.runtime = runtime
        cookie = app_session_cookie(app)
        self.app_cookie = cookie.encode("latin-1") if cookie is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await RequestCycle(self, scope, receive, send).run()
        elif kind == "websocket":
            await TunnelCycle(self, scope, receive, send).run()
        else:
            await self.app(scope, receive, send)  # lifespan (and anything else) passes


class RequestCycle:
    """One HTTP request through the door, as uvicorn's `RequestResponseCycle` is one
    through its protocol: admitted (a `/run` or `/seed_session` body read ahead for its
    rollout identity, `read_body`, and handed to the app again, `replay`), the app run,
    and its answer watched on the way out (`send`)."""

    __slots__ = (
        "door",
        "runtime",
        "scope",
        "_receive",
        "_send",
        "flight",
        "buffered",
        "kept",
        "status",
        "app_session",
        "told",
        "head",
    )
    flight: InFlight

    def __init__(self, door: AsgiDoor, scope: Scope, receive: Receive, send: Send) -> None:
        self.door = door
        self.runtime = door.runtime
        self.scope = scope
        self._receive = receive  # the server's
        self._send = send
        self.buffered: list[bytes] = []  # the body read ahead, until the app reads it
        self.kept: _KeptBody | None = None  # the body as the app read it, for a hand-over
        self.status = 0  # the answer's, once it starts
        self.app_session: str | None = None  # the app's session its answer's cookie names
        self.told = False  # the runtime was told the answer (at its last byte)
        self.head: Message | None = None  # a sized answer's start, sent with its first body

    async def run(self) -> None:
        runtime, scope = self.runtime, self.scope
        try:
            flight = self.flight = await runtime.admit(_facts(scope), self.read_body)
        except GymError as exc:
            await send_error(self._send, exc)
            return
        scope[SCOPE_KEY] = RequestContext(runtime, flight)
        receive = self.replay if self.buffered else self._receive
        if flight.episode is not None and flight.episode.exported and hands_over(runtime):
            # A /run may be handed over to another worker with its body (worker.handovers).
            self.kept = _KeptBody(receive)
            receive = self.kept.receive
        try:
            await self.door.app(scope, receive, self.send)
        except asyncio.CancelledError:
            if not own_cancellation(flight):
                raise
            await self._stopped()
        except GymError as exc:
            if self.status:
                raise
            await send_error(self._send, exc)
        else:
            if not self.told:
                runtime.answered(flight, self.status, self.app_session)
        finally:
            runtime.leave(flight)

    async def read_body(self) -> bytes:
        """The whole body, for admission to read the rollout identity in it."""
        buffered, size = self.buffered, 0
        while True:
            message = await self._receive()
            if message["type"] != "http.request":
                break
            buffered.append(message.get("body", b""))
            size += len(buffered[-1])
            if size > RUN_BODY_LIMIT:
                raise GymError("request_too_large", "a /run or /seed_session body over 64 MiB")
            if not message.get("more_body"):
                break
        return b"".join(buffered)

    async def replay(self) -> Message:
        """The app's `receive` after a body was read ahead: that body, then the server's."""
        if self.buffered:
            body = b"".join(self.buffered)
            self.buffered.clear()
            return {"type": "http.request", "body": body, "more_body": False}
        return await self._receive()

    async def send(self, message: Message) -> None:
        """The app's `send`: its answer on the way out."""
        kind = message["type"]
        if kind == "http.response.start":
            await self._starts(message)
            if _sized(message):
                # uvicorn writes the head as it gets it, and a FastAPI app's body comes
                # loop turns later (NeMo Gym's: 1-6 ms), so the proxy woke and read twice
                # a call; sent with the body, both leave in one turn and arrive as one.
                self.head = message
                return
        elif kind == "http.response.body":
            head, self.head = self.head, None
            if head is not None:
                await self._send(head)
            if not message.get("more_body"):
                # Before the last byte leaves, as the aiohttp door does: a client that
                # has the whole answer may send its next call (a prepare) at once.
                self.told = True
                self.runtime.answered(self.flight, self.status, self.app_session)
        await self._send(message)

    async def _starts(self, start: Message) -> None:
        """The answer starts: held while a model's checkpoint is open, its status and
        app session noted, and an app session's start or end announced to the proxy."""
        runtime, flight = self.runtime, self.flight
        flight.responding = True
        await runtime.hold_answer(flight)
        self.status = start["status"]
        if runtime.app_keyed:
            headers = start.get("headers", ())
            self.app_session = session_in_headers(headers, True, self.door.app_cookie)
        announce = _announcement(runtime, flight, self.app_session, self.status)
        if announce is not None:
            start["headers"] = [*start.get("headers", ()), announce]

    async def _stopped(self) -> None:
        """The runtime cancelled the request: a hand-over gives it back to the proxy with
        its body (the marker); a retired one is refused, unless its answer began."""
        handover = self.flight.handover
        if handover is not None and handover.id is not None and self.kept is not None:
            await _send_handover_marker(self._send, handover, await self.kept.whole())
        elif not self.status:
            await send_error(self._send, GymError("stale_attempt", "this attempt was retired"))


class TunnelCycle:
    """One WebSocket through the door: admitted like a request, a tunnel once the app
    accepts it, which a checkpoint may close (`close`)."""

    __slots__ = ("door", "runtime", "scope", "_receive", "_send", "flight")
    flight: InFlight

    def __init__(self, door: AsgiDoor, scope: Scope, receive: Receive, send: Send) -> None:
        self.door = door
        self.runtime = door.runtime
        self.scope = scope
        self._receive = receive
        self._send = send

    async def run(self) -> None:
        runtime, scope = self.runtime, self.scope
        try:
            flight = self.flight = await runtime.admit(_facts(scope, websocket=True), _no_body)
        except GymError as exc:
            await _refuse_websocket(scope, self._send, exc)
            return
        scope[SCOPE_KEY] = RequestContext(runtime, flight)
        try:
            await self.door.app(scope, self._receive, self.send)
        except asyncio.CancelledError:
            if not own_cancellation(flight):
                raise
        finally:
            runtime.leave(flight)

    async def send(self, message: Message) -> None:
        """The app's `send`: an accepted WebSocket is a tunnel from then on."""
        await self._send(message)
        if message["type"] == "websocket.accept":
            self.runtime.tunnel_opened(self.flight, self.close)

    def close(self) -> None:
        # 1012 "service restart": the client reconnects and waits at the door; the app's
        # next receive() sees the disconnect.
        message = {"type": "websocket.close", "code": 1012, "reason": "checkpoint"}
        asyncio.ensure_future(self._send(message))


def _facts(scope: Scope, websocket: bool = False) -> RequestFacts:
    """What admission needs to know from the request's head (a WebSocket's: its path,
    session and app session claim)."""
    session_id = claim = None
    new_session = app_token = False
    for name, value in scope["headers"]:
        if name == SESSION_ID:
            session_id = value.decode("latin-1")
        elif name == SESSION_NEW:
            new_session = value == b"1"
        elif name == APP_SESSION_CLAIM:
            claim = value.decode("latin-1")
        elif name == APP_TOKEN:  # only an app's own gets this far
            app_token = True
    key, path = split_rollout_path(scope["path"])
    if websocket:
        return RequestFacts("GET", path, session_id, False, key, app_session=claim)
    return RequestFacts(scope["method"], path, session_id, new_session, key, app_token, claim)


async def _no_body() -> bytes:
    return b""


class _KeptBody:
    """The request body as the app received it, kept for a hand-over: `whole()` is all
    of it (what the app has not read yet is read then)."""

    __slots__ = ("_receive", "_chunks", "_complete")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._chunks: list[bytes] = []
        self._complete = False

    async def receive(self) -> Message:
        message = await self._receive()
        self._keep(message)
        return message

    def _keep(self, message: Message) -> None:
        if message["type"] != "http.request":
            self._complete = True
            return
        self._chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            self._complete = True

    async def whole(self) -> bytes:
        while not self._complete:
            self._keep(await self._receive())
        return b"".join(self._chunks)


def _sized(start: Message) -> bool:
    """An answer whose length its head gives (not a stream, whose head a client may wait
    for before the first event)."""
    return any(name == b"content-length" for name, _ in start.get("headers", ()))


async def _send_handover_marker(send: Send, handover: Any, body: bytes) -> None:
    """The answer that gives the request back to the proxy (worker.handovers)."""
    headers = [
        (HANDOVER_HEADER, handover.id.encode("latin-1")),
        (b"content-length", b"%d" % len(body)),
    ]
    handover.sent = True
    await send({"type": "http.response.start", "status": HANDOVER_STATUS, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _refuse_websocket(scope: Scope, send: Send, error: GymError) -> None:
    """Refuse a WebSocket handshake with the JSON error when the server can send an HTTP
    answer to it (the ASGI `websocket.http.response` extension), else close (403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        body = error.body()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        start = {"type": "websocket.http.response.start", "status": error.status}
        await send({**start, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1013})


def _announcement(
    runtime: ParticipantRuntime, flight: InFlight, app_session: str | None, status: int
) -> tuple[bytes, bytes] | None:
    """The header that tells the proxy an app session starts (its first 2xx seed) or
    ends (a 2xx close) here, so its table of app sessions follows the sessions."""
    if app_session is None or not 200 <= status < 300:
        return None
    if flight.path == "/seed_session" and app_session not in runtime.store:
        return APP_SESSION, app_session.encode("latin-1")
    if runtime.ends_session(flight.path) and app_session in runtime.store:
        return APP_SESSION_END, app_session.encode("latin-1")
    return None


def answer_runtime_errors(app: Any) -> None:
    """Let a Starlette (FastAPI) app answer the runtime's refusals raised in its handlers
    (`current_session`, `episode`) with their own status and JSON body: Starlette turns
    any other exception into a plain-text 500 before the door could see it."""
    starlette = starlette_app(app)
    if starlette is None:
        return

    async def handler(request: Any, error: GymError) -> Any:
        from starlette.responses import Response

        retry = {"retry-after": "1"} if error.code in RETRY_AFTER else None
        return Response(error.body(), error.status, retry, "application/json")

    starlette.add_exception_handler(GymError, handler)


async def send_error(send: Send, error: GymError) -> None:
    """Answer with the JSON error body (status and Retry-After from the one table)."""
    body = error.body()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if error.code in RETRY_AFTER:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
