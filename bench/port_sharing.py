"""The design gym-proxy replaces: N uvicorn workers on one shared port, each with an
in-worker router that forwards a request to the worker owning its session.

    GYM_BENCH_SHARE_DIR=/tmp/x uvicorn port_sharing:app --app-dir bench --workers 4

Under `uvicorn --workers N` the kernel hands each connection to any worker, so a
session's calls land anywhere. Each worker therefore also listens on its own Unix socket
(`<share dir>/<pid>.sock`); `POST /seed_session` mints a session ID that names the
worker (`<pid>.<n>`), and a request whose `x-ng-session-id` names another worker is
forwarded there by a middleware with a pooled keep-alive HTTP client (aiohttp), the way
multi-worker servers without a routing front end keep sessions. The app behind the
router is the same counter the other front ends serve (`asgi_counter.app`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvicorn
from asgi_counter import app as counter
from asgi_counter import read_body
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

SHARE_DIR = Path(os.environ.get("GYM_BENCH_SHARE_DIR", "/tmp/gym-bench-share"))
_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"host", b"content-length"}


class Router:
    """ASGI middleware: serve own sessions, forward the rest to their worker's socket."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.pid = str(os.getpid())
        self.counter = itertools.count()
        self.clients: dict[str, aiohttp.ClientSession] = {}
        self.server: asyncio.AbstractServer | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/seed_session":
            session = f"{self.pid}.{next(self.counter)}".encode()
            await _reply(send, orjson.dumps({"session_id": session.decode()}))
            return
        session = dict(scope["headers"]).get(b"x-ng-session-id", b"")
        owner = session.split(b".", 1)[0].decode()
        if not owner or owner == self.pid:
            await self.app(scope, receive, send)
        else:
            await self._forward(owner, scope, receive, send)

    async def _forward(self, owner: str, scope: dict[str, Any], receive: Any, send: Any) -> None:
        client = self.clients.get(owner)
        if client is None:
            connector = aiohttp.UnixConnector(path=str(SHARE_DIR / f"{owner}.sock"), limit=0)
            client = self.clients[owner] = aiohttp.ClientSession(connector=connector)
        body = await read_body(receive)
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k not in _HOP]
        async with client.request(
            scope["method"], f"http://worker{scope['path']}", headers=headers, data=body
        ) as resp:
            payload = await resp.read()
            out = [(k.encode(), v.encode()) for k, v in resp.headers.items()]
            out = [(k, v) for k, v in out if k.lower() not in _HOP]
        await _reply(send, payload, resp.status, out)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self._listen()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for client in self.clients.values():
                    await client.close()
                if self.server is not None:
                    self.server.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _listen(self) -> None:
        """This worker's own socket, served by uvicorn's protocol in this process."""
        path = SHARE_DIR / f"{self.pid}.sock"  # the directory exists: the bench made it
        config = uvicorn.Config(self.app, http="httptools", lifespan="off", access_log=False)
        config.load()
        state = ServerState()
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(
            lambda: HttpToolsProtocol(config=config, server_state=state, app_state={}), str(path)
        )


async def _reply(
    send: Any, body: bytes, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = headers or [(b"content-type", b"application/json")]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})


app = Router(counter)
