"""Serve an ASGI app on the worker's private Unix socket with uvicorn (httptools), or on
the connections a remote worker's gate hands on (`worker.link_gate`).

uvicorn is what NeMo Gym runs its servers on. The worker drives uvicorn's server from its
own event loop (uvloop) and keeps its own signal handling: uvicorn's `serve()` would take
over SIGTERM/SIGINT, so the worker calls the steps `serve()` is made of itself: lifespan
startup (a failure is a boot error), listening, the main loop, then shutdown (graceful,
then lifespan shutdown).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn

from gym_proxy.coordinator.contract.keepalive import WORKER_KEEPALIVE
from gym_proxy.worker.identity import WORKER_BACKLOG

__all__ = ["AsgiWorkerServer", "AppStartupFailed"]


class AppStartupFailed(Exception):
    """The app's lifespan startup failed."""


class AsgiWorkerServer:
    """One uvicorn server for one worker socket (None: it listens on none, and the gate
    makes its connections' protocols with `http_protocol`)."""

    def __init__(self, app: Any, socket_path: str | None, graceful_timeout: float, log_level: str):
        self.config = uvicorn.Config(
            app,
            uds=socket_path,
            backlog=WORKER_BACKLOG,
            interface="asgi3",
            http="httptools",
            lifespan="auto",
            timeout_keep_alive=int(WORKER_KEEPALIVE),
            # uvicorn annotates it int; it is a timeout of asyncio.wait_for, seconds as float
            timeout_graceful_shutdown=graceful_timeout,  # type: ignore[arg-type]
            log_config=None,
            log_level=logging.getLevelName(log_level.upper()),
            access_log=False,
            proxy_headers=False,
            server_header=False,
        )
        self.server = uvicorn.Server(self.config)
        self._main: asyncio.Task[None] | None = None
        self._stopped = False

    async def start(self) -> None:
        """Run the lifespan startup and listen; AppStartupFailed if the startup failed."""
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        try:
            await self.server.startup(sockets=None if self.config.uds else [])
        except SystemExit:  # uvicorn exits when the lifespan startup fails
            raise AppStartupFailed("the app's lifespan startup failed (see above)") from None
        self._main = asyncio.ensure_future(self.server.main_loop())

    def http_protocol(self) -> asyncio.Protocol:
        """A new connection's protocol, as uvicorn's listener would make it."""
        config, server = self.config, self.server
        return config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=server.server_state, app_state=server.lifespan.state
        )

    async def stop(self) -> None:
        """Stop accepting, let requests finish (graceful timeout), run lifespan shutdown;
        once (stopped, it has nothing left to do)."""
        if self._stopped:
            return
        self._stopped = True
        self.server.should_exit = True
        if self._main is not None:
            await self._main
        if self.server.started:
            await self.server.shutdown()
