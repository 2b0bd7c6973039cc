"""ASGI apps the tests' workers run (importable as `tests.asgi_apps:<name>`).

`create_app` is the Starlette twin of `tests.apps:create_app`: the same routes and the
same behaviour, so the participant tests run over both app kinds. It strips
`/ng-rollout/<key>/` itself, as NeMo Gym's RolloutContextMiddleware does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from gym_proxy.coordinator.contract.headers import split_rollout_path
from gym_proxy.worker.declaration import KINDS, TUNNEL_POLICIES
from gym_proxy.worker.participant import Participation, context, current_session, declare, episode
from tests.apps import env_choice, hold_while_file

STATE: dict[str, Any] = {"seen": [], "gates": {}, "cancelled": [], "progress": {}, "generating": 0}


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status, media_type="application/json")


def _info(request: Request) -> dict[str, Any]:
    worker = context(request).worker
    return {"owner": worker.owner, "slot": worker.slot, "pid": worker.pid}


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    body = orjson.loads(raw)
    return body if isinstance(body, dict) else {}


def _gate(name: str) -> asyncio.Event:
    return STATE["gates"].setdefault(name, asyncio.Event())


async def seed_session(request: Request) -> Response:
    count = (await _body(request)).get("initial_count", 0)
    current_session(request).set(count)
    return _json({"count": count})


async def increment_counter(request: Request) -> Response:
    session = current_session(request)
    count = session.get(0) + (await _body(request)).get("count", 1)
    session.set(count)
    return _json({"count": count})


async def get_counter_value(request: Request) -> Response:
    return _json({"count": current_session(request).get(0)})


async def verify(request: Request) -> Response:
    expected = (await _body(request)).get("expected_count")
    actual = current_session(request).get(0)
    return _json({"reward": 1.0 if actual == expected else 0.0, "count": actual})


async def whoami(request: Request) -> Response:
    headers = {k.lower(): v for k, v in request.headers.items()}
    return _json(
        {
            **_info(request),
            "session_id": headers.get("x-ng-session-id"),
            "session_token": headers.get("x-ng-session-token"),
            "headers": headers,
        }
    )


async def seen(request: Request) -> Response:
    entries = STATE["seen"][:-1]
    return _json(
        {
            **_info(request),
            "paths": [path for path, _ in entries],
            "session_ids": [sid for _, sid in entries],
        }
    )


async def sse(request: Request) -> Response:
    name = request.query_params["name"]
    count = int(request.query_params.get("n", "3"))

    async def events():
        for i in range(count):
            yield f"data: event-{i}\n\n".encode()
            if i + 1 < count:
                await _gate(f"{name}-{i}").wait()

    return StreamingResponse(events(), headers={"content-type": "text/event-stream"})


async def release(request: Request) -> Response:
    _gate(request.query_params["name"]).set()
    return _json({"released": request.query_params["name"]})


async def generate(request: Request) -> Response:
    """A model's generation route (run with GYM_TEST_KIND=model): waits for `generate`."""
    STATE["generating"] += 1
    try:
        await _gate("generate").wait()
    finally:
        STATE["generating"] -= 1
    return _json({**_info(request), "generated": True})


async def generating(request: Request) -> Response:
    """How many generation calls are in the app (past the worker's door), waiting."""
    return _json({"waiting": STATE["generating"]})


async def upload(request: Request) -> Response:
    digest, size = hashlib.sha256(), 0
    async for chunk in request.stream():
        digest.update(chunk)
        size += len(chunk)
    return _json({"sha256": digest.hexdigest(), "size": size})


async def download(request: Request) -> Response:
    size = int(request.query_params["size"])
    block = hashlib.sha256(request.query_params.get("seed", "0").encode()).digest() * 2048

    async def pieces():
        sent = 0
        while sent < size:
            piece = block[: min(len(block), size - sent)]
            sent += len(piece)
            yield piece

    headers = {"content-length": str(size)} if request.query_params.get("length") == "1" else {}
    return StreamingResponse(pieces(), headers=headers)


async def echo(request: Request) -> Response:
    return Response(await request.body(), media_type=request.headers.get("content-type"))


async def slow(request: Request) -> Response:
    seconds = float(request.query_params.get("seconds", "1"))
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        STATE["cancelled"].append(request.query_params.get("tag", ""))
        raise
    return _json({**_info(request), "slept": seconds})


async def run(request: Request) -> Response:
    """The same test episode as tests.apps.run."""
    body = await _body(request)
    ep = episode(request)
    state = ep.restored_state or {"step": 0, "log": []}
    gate = body.get("gate")
    while state["step"] < body.get("steps", 3):
        if gate:
            await ep.replay(_gate(f"{gate}-{state['step']}").wait())
        if body.get("pause"):
            await asyncio.sleep(body["pause"])  # a step that runs (not parked) a while
        state = {"step": state["step"] + 1, "log": [*state["log"], f"{ep.key}:{state['step']}"]}
        STATE["progress"][ep.key] = state["step"]
        await ep.boundary(state)
    return _json({**_info(request), "key": ep.key, "restored": ep.restored, "state": state})


async def progress(request: Request) -> Response:
    return _json({**_info(request), "progress": STATE["progress"]})


async def cancelled(request: Request) -> Response:
    return _json({**_info(request), "cancelled": STATE["cancelled"]})


async def sessions(request: Request) -> Response:
    return _json({**_info(request), "sessions": len(context(request).runtime.store)})


async def close_session(request: Request) -> Response:
    return _json({"closed": request.headers.get("x-ng-session-id")})


class RolloutPrefix:
    """Strip `/ng-rollout/<key>/` and record every request (path, proxy session ID)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            with contextlib.suppress(Exception):
                _, path = split_rollout_path(scope["path"])
                scope = {**scope, "path": path, "raw_path": path.encode()}
            sid = dict(scope["headers"]).get(b"x-ng-session-id")
            STATE["seen"].append((scope["path"], sid.decode() if sid else None))
            if scope["path"] == "/late_body":
                await late_body(send)
                return
        await self.app(scope, receive, send)


async def late_body(send: Send) -> None:
    """A sized answer whose body comes after its head, as a FastAPI app's does through
    its middleware (loop turns apart): here once the test opens the gate "late_body"
    (`/release?name=late_body`)."""
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"4")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await _gate("late_body").wait()
    await send({"type": "http.response.body", "body": b"late"})


async def ws_echo(websocket: WebSocket) -> None:
    """Echoes text frames with the worker and session that answered (a tunnel)."""
    await websocket.accept()
    ctx = context(websocket)
    info = {"owner": ctx.worker.owner, "slot": ctx.worker.slot, "pid": ctx.worker.pid}
    session = dict(websocket.scope["headers"]).get(b"x-ng-session-id", b"").decode()
    with contextlib.suppress(WebSocketDisconnect):
        while True:
            text = await websocket.receive_text()
            await websocket.send_text(
                orjson.dumps({**info, "session_id": session, "echo": text}).decode()
            )


def create_app() -> Any:
    """The Starlette twin of tests.apps:create_app, a session-store participant."""
    hold_while_file()
    app = Starlette(
        routes=[
            Route("/seed_session", seed_session, methods=["POST"]),
            Route("/increment_counter", increment_counter, methods=["POST"]),
            Route("/get_counter_value", get_counter_value, methods=["GET", "POST"]),
            Route("/verify", verify, methods=["POST"]),
            Route("/whoami", whoami, methods=["GET", "POST"]),
            Route("/seen", seen),
            Route("/sse", sse),
            Route("/release", release, methods=["GET", "POST"]),
            Route("/upload", upload, methods=["POST"]),
            Route("/v1/responses", generate, methods=["POST"]),
            Route("/generating", generating),
            Route("/download", download),
            Route("/echo", echo, methods=["POST"]),
            Route("/slow", slow, methods=["GET", "POST"]),
            Route("/cancelled", cancelled),
            Route("/run", run, methods=["POST"]),
            Route("/progress", progress),
            Route("/sessions", sessions),
            Route("/close_session", close_session, methods=["POST"]),
            WebSocketRoute("/ws", ws_echo),
        ]
    )
    wrapped = RolloutPrefix(app)
    kind = env_choice("GYM_TEST_KIND", KINDS, "resources")
    tunnels = env_choice("GYM_TEST_TUNNELS", TUNNEL_POLICIES, "close")
    return declare(wrapped, Participation(kind=kind, tunnels=tunnels))


def broken_lifespan() -> Any:
    """An ASGI app whose lifespan startup fails."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        raise RuntimeError("cannot connect to the database")
        yield  # pragma: no cover

    return Starlette(routes=[], lifespan=lifespan)


async def bare_asgi(scope: Scope, receive: Receive, send: Send) -> None:
    """The smallest ASGI app (no lifespan support): answers its path."""
    if scope["type"] != "http":
        raise RuntimeError("lifespan is not supported")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": scope["path"].encode()})
