"""Apps that gym-proxy workers run in tests (importable as `tests.apps:<factory>`)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web

from gym_proxy.worker.counter import create_app as create_counter_app
from gym_proxy.worker.declaration import KINDS, TUNNEL_POLICIES
from gym_proxy.worker.identity import WORKER_INFO, session_id, session_token
from gym_proxy.worker.participant import RUNTIME, ParticipantHooks, Participation, declare, episode

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

C = TypeVar("C", bound=str)

SEEN = web.AppKey("seen", list)
GATES = web.AppKey("gates", dict)
CANCELLED = web.AppKey("cancelled", list)
PROGRESS = web.AppKey("progress", dict)
STOPPED = web.AppKey("stopped", list)
GENERATING = web.AppKey("generating", list)  # one count: calls inside `generate`


def _info(request: web.Request) -> dict[str, object]:
    info = request.app[WORKER_INFO]
    return {"owner": info.owner, "slot": info.slot, "pid": info.pid}


async def whoami(request: web.Request) -> web.Response:
    return web.json_response(
        {
            **_info(request),
            "session_id": session_id(request),
            "session_token": session_token(request),
            "headers": {k.lower(): v for k, v in request.headers.items()},
        }
    )


async def seen(request: web.Request) -> web.Response:
    # The /seen call itself is the last entry; report what came before it.
    entries = request.app[SEEN][:-1]
    return web.json_response(
        {
            **_info(request),
            "paths": [path for path, _ in entries],
            "session_ids": [sid for _, sid in entries],
        }
    )


def _gate(request: web.Request, name: str) -> asyncio.Event:
    return request.app[GATES].setdefault(name, asyncio.Event())


async def sse(request: web.Request) -> web.StreamResponse:
    """Event i is sent only after `/release?name=<name>-<i>` (so arrival proves streaming)."""
    name = request.query["name"]
    count = int(request.query.get("n", "3"))
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for i in range(count):
        await response.write(f"data: event-{i}\n\n".encode())
        if i + 1 < count:
            await _gate(request, f"{name}-{i}").wait()
    await response.write_eof()
    return response


async def release(request: web.Request) -> web.Response:
    _gate(request, request.query["name"]).set()
    return web.json_response({"released": request.query["name"]})


async def generate(request: web.Request) -> web.Response:
    """A model's generation route (run with GYM_TEST_KIND=model): waits for `generate`."""
    request.app[GENERATING][0] += 1
    try:
        await _gate(request, "generate").wait()
    finally:
        request.app[GENERATING][0] -= 1
    return web.json_response({**_info(request), "generated": True})


async def generating(request: web.Request) -> web.Response:
    """How many generation calls are in the app (past the worker's door), waiting."""
    return web.json_response({"waiting": request.app[GENERATING][0]})


async def upload(request: web.Request) -> web.Response:
    digest = hashlib.sha256()
    size = 0
    async for chunk in request.content.iter_any():
        digest.update(chunk)
        size += len(chunk)
    return web.json_response({"sha256": digest.hexdigest(), "size": size})


def pattern_block(seed: int) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * 2048  # 64 KiB


async def download(request: web.Request) -> web.StreamResponse:
    size = int(request.query["size"])
    block = pattern_block(int(request.query.get("seed", "0")))
    response = web.StreamResponse()
    if request.query.get("length") == "1":
        response.content_length = size
    await response.prepare(request)
    sent = 0
    while sent < size:
        piece = block[: min(len(block), size - sent)]
        await response.write(piece)
        sent += len(piece)
    await response.write_eof()
    return response


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.Response(body=body, content_type=request.content_type)


async def slow(request: web.Request) -> web.Response:
    seconds = float(request.query.get("seconds", "1"))
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        request.app[CANCELLED].append(request.query.get("tag", ""))
        raise
    return web.json_response({**_info(request), "slept": seconds})


async def block(request: web.Request) -> web.Response:
    """Blocks the worker's event loop `?seconds=` (a CPU-bound handler that never awaits)."""
    seconds = float(request.query.get("seconds", "1"))
    time.sleep(seconds)  # noqa: ASYNC251 -- blocking the loop is what it is for
    return web.json_response({**_info(request), "blocked": seconds})


async def run(request: web.Request) -> web.Response:
    """A test episode: `steps` steps, each a replay step that waits for gate
    `<gate>-<step>` (when `gate` is given) and runs `pause` seconds, then a boundary with the
    new state."""
    body = await request.json()
    ep = episode(request)
    state = ep.restored_state or {"step": 0, "log": []}
    gate = body.get("gate")
    while state["step"] < body.get("steps", 3):
        if gate:
            await ep.replay(_gate(request, f"{gate}-{state['step']}").wait())
        if body.get("pause"):
            await asyncio.sleep(body["pause"])  # a step that runs (not parked) a while
        state = {"step": state["step"] + 1, "log": [*state["log"], f"{ep.key}:{state['step']}"]}
        request.app[PROGRESS][ep.key] = state["step"]
        await ep.boundary(state)
    return web.json_response(
        {**_info(request), "key": ep.key, "restored": ep.restored, "state": state}
    )


async def progress(request: web.Request) -> web.Response:
    return web.json_response({**_info(request), "progress": request.app[PROGRESS]})


async def sessions(request: web.Request) -> web.Response:
    """How many sessions this worker's participant runtime holds."""
    return web.json_response({**_info(request), "sessions": len(request.app[RUNTIME].store)})


async def close_session(request: web.Request) -> web.Response:
    return web.json_response({"closed": session_id(request)})


async def answer(request: web.Request) -> web.StreamResponse:
    """Answers `?status=N` without reading the body, or (`?close=1`) closes the
    connection without answering: a worker that closes early."""
    if request.query.get("close") == "1":
        assert request.transport is not None
        request.transport.close()
    return web.json_response({**_info(request)}, status=int(request.query.get("status", "200")))


async def stopped(request: web.Request) -> web.Response:
    """How often this worker's app heard a commit's `stop` (its `stop` hook)."""
    return web.json_response({**_info(request), "stopped": len(request.app[STOPPED])})


async def cancelled(request: web.Request) -> web.Response:
    return web.json_response({**_info(request), "cancelled": request.app[CANCELLED]})


@web.middleware
async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
    # The path and the identity the request arrived with: every request the proxy sends
    # carries its x-ng-session-id, so one without it (or with a client's value) was parsed
    # by the worker but not by the proxy.
    request.app[SEEN].append((request.path, request.headers.get("x-ng-session-id")))
    return await handler(request)


async def ws_echo(request: web.Request) -> web.WebSocketResponse:
    """Echoes text frames with the worker and session that answered (a tunnel)."""
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    async for message in ws:
        if message.type == web.WSMsgType.TEXT:
            await ws.send_json(
                {**_info(request), "session_id": session_id(request), "echo": message.data}
            )
    return ws


def env_choice(name: str, choices: tuple[C, ...], default: C) -> C:
    """The environment's `name`, one of `choices` (`default` when unset)."""
    value = os.environ.get(name, default)
    for choice in choices:
        if choice == value:
            return choice
    raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def hold_while_file() -> None:
    """Lets a test keep a restarted worker from booting until it removes the file named
    by GYM_TEST_HOLD_FILE (a blocking wait, at boot, before the app exists)."""
    hold = os.environ.get("GYM_TEST_HOLD_FILE")
    if hold:
        deadline = time.monotonic() + 60
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)


# In process only (`tests/in_process.py`): while a test sets it, a worker that starts
# waits for it to be set before it builds its app (`create_app_once_let_in`).
boot_gate: asyncio.Event | None = None


async def create_app_once_let_in() -> web.Application:
    """`create_app`, once `boot_gate` lets the worker in: it awaits, so the proxy and the
    other workers, in the same loop, run on meanwhile."""
    if boot_gate is not None:
        await boot_gate.wait()
    return create_app()


def refuse_while_file() -> None:
    """Lets a test make a worker that starts from now on fail to boot: while the file
    named by GYM_TEST_BROKEN_FILE exists, the app cannot be built."""
    broken = os.environ.get("GYM_TEST_BROKEN_FILE")
    if broken and os.path.exists(broken):
        raise RuntimeError(f"{broken} exists: this worker cannot build the app")


def create_app() -> web.Application:
    """The counter app plus test routes."""
    hold_while_file()
    refuse_while_file()
    app = create_counter_app()
    kind = env_choice("GYM_TEST_KIND", KINDS, "resources")
    app[STOPPED] = []

    async def stop() -> None:
        app[STOPPED].append(True)

    # State in the session store; a `stop` hook only (no export hook: the store exports).
    participation = Participation(
        kind=kind,
        tunnels=env_choice("GYM_TEST_TUNNELS", TUNNEL_POLICIES, "close"),
        hooks=ParticipantHooks(stop=stop),
    )
    declare(app, participation)
    app.middlewares.append(record)
    app[SEEN] = []
    app[GATES] = {}
    app[GENERATING] = [0]
    app[CANCELLED] = []
    app[PROGRESS] = {}
    app.router.add_route("*", "/whoami", whoami)
    app.router.add_get("/seen", seen)
    app.router.add_get("/sse", sse)
    app.router.add_route("*", "/release", release)
    app.router.add_post("/upload", upload)
    app.router.add_post("/v1/responses", generate)
    app.router.add_get("/generating", generating)
    app.router.add_get("/download", download)
    app.router.add_post("/echo", echo)
    app.router.add_route("*", "/slow", slow)
    app.router.add_route("*", "/block", block)
    app.router.add_get("/cancelled", cancelled)
    app.router.add_get("/stopped", stopped)
    app.router.add_route("*", "/answer", answer)
    app.router.add_post("/run", run)
    app.router.add_get("/progress", progress)
    app.router.add_get("/sessions", sessions)
    app.router.add_post("/close_session", close_session)
    app.router.add_get("/ws", ws_echo)
    return app


async def hold(request: web.Request) -> web.Response:
    """Stays in flight until `/release?name=<name>` on the same worker."""
    await _gate(request, request.query["name"]).wait()
    return web.json_response({**_info(request), "held": request.query["name"]})


def create_restart_only_app() -> web.Application:
    """The counter app declared restart-only (`Participation(restart_only=True)`), as a
    server that declares no state is: it exports nothing and names as restarts the
    episodes of its live sessions and of its requests in flight; `/hold` keeps a request
    in flight until `/release`."""
    app = create_counter_app()
    declare(app, Participation(restart_only=True))
    app[GATES] = {}
    app.router.add_route("*", "/hold", hold)
    app.router.add_route("*", "/release", release)
    return app


def broken_factory() -> web.Application:
    raise RuntimeError("this app cannot be built")
