"""A resources server written the way NeMo Gym writes them (nemo-gym itself needs Python
3.13, so the test reproduces its stack, from nemo_gym/server_utils.py and
base_resources_server.py / mcp_auto_exposure.py):

- a FastAPI app; Starlette's SessionMiddleware with the cookie (and secret) named
  `<ServerClass>___<name>`, an `add_session_id` middleware that puts a uuid4 under
  `session_id` into every request's session, and RolloutContextMiddleware outermost
  (it strips `/ng-rollout/<id>` and passes a copy of the scope down);
- state in the server's own dict, keyed by that session ID;
- `/seed_session` answers MCP metadata with an itsdangerous `URLSafeSerializer` token
  (salt `nemo-gym-mcp-session-token`) over the session ID, sent back by MCP clients as
  `X-NeMo-Gym-Session-Token`;
- an MCP endpoint (the SDK's low-level Server and StreamableHTTPSessionManager,
  stateless, JSON responses) mounted at `/mcp`, run in the app's lifespan.

`create_app` is what a user writes to run it under gym-proxy: build the server, take its
FastAPI app, and declare checkpoint hooks over the server's dict.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any
from uuid import uuid4

import mcp.types as types
import orjson
from fastapi import FastAPI, Request
from itsdangerous import BadSignature, URLSafeSerializer
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import BaseModel
from starlette.middleware.sessions import SessionMiddleware
from starlette.routing import Mount, Route

from worker.participant import ParticipantHooks, Participation, declare

SESSION_ID_KEY = "session_id"
TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
TOKEN_SALT = "nemo-gym-mcp-session-token"


class SeedBody(BaseModel):
    initial_count: int = 0


class CountBody(BaseModel):
    count: int = 1


class VerifyBody(BaseModel):
    expected_count: int


class RolloutContextMiddleware:
    """NeMo Gym's: strip `/ng-rollout/<id>` and hand a copy of the scope downstream."""

    _PREFIX = re.compile(r"^/ng-rollout/(?P<rollout_id>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<rest>/.*)$")

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        match = self._PREFIX.match(scope.get("path", "")) if scope.get("type") == "http" else None
        if match is None:
            await self._app(scope, receive, send)
            return
        path = match.group("rest")
        await self._app({**scope, "path": path, "raw_path": path.encode()}, receive, send)


class CounterResourcesServer:
    """Counters per NeMo Gym session, reachable over HTTP (cookie) and MCP (token)."""

    def __init__(self, name: str = "counter") -> None:
        self.name = name
        self.counters: dict[str, int] = {}
        self.stopped = 0  # commits with stop: true seen

    def get_session_middleware_key(self) -> str:
        return f"{type(self).__name__}___{self.name}"

    def serializer(self) -> URLSafeSerializer:
        return URLSafeSerializer(self.get_session_middleware_key(), salt=TOKEN_SALT)

    def setup_webserver(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def add_session_id(request: Request, call_next):  # type: ignore[no-untyped-def]
            request.session[SESSION_ID_KEY] = request.session.get(SESSION_ID_KEY, str(uuid4()))
            return await call_next(request)

        key = self.get_session_middleware_key()
        app.add_middleware(SessionMiddleware, secret_key=key, session_cookie=key)
        app.add_middleware(RolloutContextMiddleware)  # outermost, as in NeMo Gym 0.7
        app.post("/seed_session")(self.seed_session)
        app.post("/increment_counter")(self.increment_counter)
        app.post("/get_counter_value")(self.get_counter_value)
        app.post("/verify")(self.verify)
        app.get("/whoami")(self.whoami)
        app.get("/stopped")(self.stopped_count)
        self._mount_mcp(app)
        return app

    async def seed_session(self, request: Request, body: SeedBody) -> dict[str, Any]:
        sid = request.session[SESSION_ID_KEY]
        self.counters[sid] = body.initial_count
        token = self.serializer().dumps(sid)
        return {
            "count": body.initial_count,
            "mcp": {"server_name": self.name, "url_path": "/mcp", "headers": {TOKEN_HEADER: token}},
        }

    async def increment_counter(self, request: Request, body: CountBody) -> dict[str, Any]:
        sid = request.session[SESSION_ID_KEY]
        self.counters[sid] = self.counters.get(sid, 0) + body.count
        return {"count": self.counters[sid], "pid": os.getpid()}

    async def get_counter_value(self, request: Request) -> dict[str, Any]:
        return {"count": self.counters.get(request.session[SESSION_ID_KEY], 0)}

    async def verify(self, request: Request, body: VerifyBody) -> dict[str, Any]:
        actual = self.counters.get(request.session[SESSION_ID_KEY], 0)
        return {"reward": 1.0 if actual == body.expected_count else 0.0, "count": actual}

    async def stopped_count(self) -> dict[str, Any]:
        return {"stopped": self.stopped, "pid": os.getpid()}

    async def whoami(self, request: Request) -> dict[str, Any]:
        return {"pid": os.getpid(), "session_id": request.session.get(SESSION_ID_KEY)}

    def _mount_mcp(self, app: FastAPI) -> None:
        server = Server(self.name)

        def session_id() -> str:
            request = server.request_context.request
            token = request.headers.get(TOKEN_HEADER) if request is not None else None
            if not token:
                raise ValueError(f"Missing {TOKEN_HEADER} for Gym MCP tool call.")
            try:
                claims = self.serializer().loads(token)
            except BadSignature as exc:
                raise ValueError("Invalid Gym MCP session token.") from exc
            return claims["sid"] if isinstance(claims, dict) else claims

        @server.list_tools()
        async def list_tools() -> list[types.Tool]:
            schema = {"type": "object", "properties": {"count": {"type": "integer"}}}
            return [types.Tool(name="increment_counter", inputSchema=schema)]

        @server.call_tool()
        async def call_tool(name: str, arguments: dict[str, Any]) -> list[types.TextContent]:
            sid = session_id()
            if sid not in self.counters:
                raise ValueError(f"no session {sid} on this worker (pid {os.getpid()})")
            self.counters[sid] += int(arguments.get("count", 1))
            payload = {"count": self.counters[sid], "pid": os.getpid()}
            return [types.TextContent(type="text", text=orjson.dumps(payload).decode())]

        manager = StreamableHTTPSessionManager(
            app=server,
            json_response=True,
            stateless=True,
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )

        class Endpoint:  # an object, not a function: Starlette routes it as raw ASGI
            async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
                await manager.handle_request(scope, receive, send)

        endpoint = Endpoint()

        app.router.routes.insert(0, Route("/mcp", endpoint, include_in_schema=False))
        app.router.routes.insert(1, Mount("/mcp", app=endpoint))
        main_lifespan = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app_: FastAPI):  # type: ignore[no-untyped-def]
            async with manager.run(), main_lifespan(app_) as state:
                yield state

        app.router.lifespan_context = lifespan

    # ---- gym-proxy hooks: the server's own dict is its session state ----------------
    async def export_sessions(self, session_ids: list[str]) -> dict[str, Any]:
        return {sid: self.counters[sid] for sid in session_ids if sid in self.counters}

    async def restore_sessions(self, states: dict[str, Any]) -> None:
        if not all(isinstance(v, int) for v in states.values()):
            raise ValueError("counter states must be integers")
        self.counters.update(states)

    async def retire_sessions(self, session_ids: list[str]) -> None:
        for sid in session_ids:
            self.counters.pop(sid, None)

    async def stop(self) -> None:
        self.stopped += 1  # a real server would stop its sandboxes here


def create_app() -> FastAPI:
    """What a gym-proxy user writes: the unmodified server's app, plus hooks."""
    server = CounterResourcesServer()
    app = server.setup_webserver()
    hooks = ParticipantHooks(
        export=server.export_sessions,
        restore=server.restore_sessions,
        retire=server.retire_sessions,
        stop=server.stop,
    )
    return declare(app, Participation(kind="resources", hooks=hooks))


def create_restart_only_app() -> FastAPI:
    """The same server with no declaration at all: a restart-only participant."""
    return CounterResourcesServer().setup_webserver()
