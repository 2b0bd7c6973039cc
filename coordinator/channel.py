"""Request/reply over one framed coordinator connection (both ends use this class).

Incoming requests are handled one at a time in arrival order, so a reply to a request is
always written before anything the handler of a *later* message writes. Handlers must be
quick and must not await a request on the same channel (they would wait on themselves);
long work belongs in a task of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from coordinator.framing import FramingError, encode_frame, read_frame

__all__ = ["Channel", "ChannelClosed", "RemoteError", "Handler"]

log = logging.getLogger("gym_proxy.channel")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]


class ChannelClosed(ConnectionError):
    """The connection ended before a reply arrived."""


class RemoteError(Exception):
    """The peer answered a request with an `error` reply."""


class Channel:
    """One end of a coordinator connection: send requests, await replies, serve requests."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def request(self, type_: str, **fields: Any) -> dict[str, Any]:
        """Send a request and return the peer's `ok` reply; raise on error or close."""
        if self._closed:
            raise ChannelClosed("channel is closed")
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self.send({"type": type_, "id": request_id, **fields})
            reply = await future
        finally:
            self._pending.pop(request_id, None)
        if reply["type"] == "error":
            raise RemoteError(str(reply.get("message", "error")))
        return reply

    async def send(self, message: dict[str, Any]) -> None:
        """Write one message (a notification, or a reply) and wait for buffer room."""
        if self._closed:
            raise ChannelClosed("channel is closed")
        try:
            self._writer.write(encode_frame(message))
            await self._writer.drain()
        except ChannelClosed:
            raise
        except ConnectionError as exc:  # one failure type for callers: the peer is gone
            self.close()
            raise ChannelClosed(f"channel write failed: {exc}") from exc

    async def serve(self) -> None:
        """Read until the peer closes; resolves replies and answers requests in order."""
        try:
            while True:
                message = await read_frame(self._reader)
                if message is None:
                    return
                kind = message["type"]
                if kind in ("ok", "error"):
                    future = self._pending.get(message.get("id"))  # type: ignore[arg-type]
                    if future is not None and not future.done():
                        future.set_result(message)
                    continue
                await self._dispatch(message)
        except FramingError as exc:
            log.error("coordinator channel dropped: %s", exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.close()

    async def _dispatch(self, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        try:
            reply = await self._handler(message)
        except Exception as exc:  # the peer gets the failure as a reply, not a dead channel
            log.debug("handler for %s failed", message["type"], exc_info=True)
            reply_msg: dict[str, Any] = {"type": "error", "message": f"{type(exc).__name__}: {exc}"}
        else:
            reply_msg = {"type": "ok", **(reply or {})}
        if request_id is not None:
            reply_msg["id"] = request_id
            try:
                await self.send(reply_msg)
            except ConnectionError:
                pass

    def close(self) -> None:
        """Close the connection and fail every request still waiting for a reply."""
        if self._closed:
            return
        self._closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed("channel closed before the reply"))
        self._pending.clear()
        self._writer.close()
