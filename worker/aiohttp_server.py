"""Serve an aiohttp app on the worker's private Unix socket (aiohttp's runner and Unix
site), or on the connections a remote worker's gate hands on (`worker.link_gate`)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gym_proxy.coordinator.contract.keepalive import WORKER_KEEPALIVE
from gym_proxy.worker.head_limits import HeadLimits
from gym_proxy.worker.identity import WORKER_BACKLOG

__all__ = ["AiohttpWorkerServer"]


class AiohttpWorkerServer:
    """An aiohttp app on the worker socket (runner + Unix site); with no socket, on the
    connections a gate hands on (`http_protocol`)."""

    def __init__(
        self,
        app: web.Application,
        socket_path: str | None,
        graceful_timeout: float,
        limits: HeadLimits,
    ):
        self.runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            handler_cancellation=True,  # a client that goes away cancels its handler
            keepalive_timeout=WORKER_KEEPALIVE,
            shutdown_timeout=graceful_timeout,
            **limits.aiohttp(),
        )
        self.socket_path = socket_path
        self._stopped = False

    async def start(self) -> None:
        await self.runner.setup()
        if self.socket_path is not None:
            await web.UnixSite(self.runner, self.socket_path, backlog=WORKER_BACKLOG).start()

    def http_protocol(self) -> asyncio.Protocol:
        server = self.runner.server
        assert server is not None  # set up by start()
        return server()

    async def stop(self) -> None:
        """Stop accepting, let requests finish (graceful timeout), run the app's cleanup;
        once (stopped, it has nothing left to do)."""
        if not self._stopped:
            self._stopped = True
            await self.runner.cleanup()
