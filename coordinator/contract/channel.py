"""Request/reply over one framed coordinator connection (both ends use this class).

- Every request has a deadline (`within` seconds): a peer that stops answering (a SIGSTOPped
  worker, a blocked event loop) costs the caller that long and no longer; the late reply
  is dropped when it comes.
- Incoming requests are handled one at a time, in arrival order, on a task of their own,
  so a reply to a request is written before anything the handler of a *later* request
  writes, while the reader keeps reading.
- `ping` is answered by the reader itself, never queued behind a long handler: it tells
  whether the peer's event loop runs, which is what liveness is about.
- An error reply carries `{code, detail}` and is raised again as the same `GymError`.
- Messages are typed (`coordinator.contract.messages`): a request is decoded before its
  handler runs (a malformed one is answered `invalid_request`, naming the message and the
  key), and a reply is decoded as the request's `REPLY` before the caller sees it: a
  `Request[R]` is answered with an `R`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.framing import FramingError, encode_frame_parts, read_frame
from gym_proxy.coordinator.contract.messages import (
    MESSAGES,
    MalformedMessage,
    Message,
    Ping,
    Pong,
    Request,
    decode,
)
from gym_proxy.coordinator.contract.telemetry import TRACEPARENT

__all__ = ["Channel", "ChannelClosed", "ChannelTimeout", "RemoteError", "Handler"]

log = logging.getLogger("gym_proxy.channel")

Handler = Callable[[Message], Awaitable[Message | None]]
R = TypeVar("R", bound=Message)


class ChannelClosed(ConnectionError):
    """The connection ended before a reply arrived."""


class ChannelTimeout(TimeoutError):
    """The peer did not reply within the request's deadline."""


class RemoteError(GymError):
    """The peer answered a request with an `error` reply (its code and detail)."""


class Channel:
    """One end of a coordinator connection: send requests, await replies, serve requests."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        messages: Mapping[str, type[Message]] = MESSAGES,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._messages = messages
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._inbox: deque[dict[str, Any]] = deque()
        self._dispatcher: asyncio.Task[None] | None = None
        self._closed = False
        # What a ping that asks is answered (a worker's: its loop lag and memory).
        self.pong: Callable[[], Pong] | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    async def request(self, message: Request[R], within: float | None = None) -> R:
        """Send a request and return the peer's `ok` reply, decoded as `message.REPLY`.

        Raises ChannelClosed, ChannelTimeout (after `within` seconds; None waits for as
        long as the channel lives) or RemoteError (an error reply, or a malformed one).
        """
        if self._closed:
            raise ChannelClosed("channel is closed")
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        kind = message.TYPE
        wire = {**message.wire(), "id": request_id}
        traceparent = TRACEPARENT.get()
        if traceparent is not None:  # a traced step: the peer's span is its child
            wire["traceparent"] = traceparent
        try:
            self.send_nowait(wire)
            try:
                reply = await asyncio.wait_for(future, within)
            except TimeoutError:
                raise ChannelTimeout(f"no reply to {kind} within {within:.3g} s") from None
        finally:
            self._pending.pop(request_id, None)
        if reply["type"] == "error":
            raise RemoteError(
                str(reply.get("code", "internal_error")), str(reply.get("detail", "error"))
            )
        try:
            return message.REPLY.decode(reply)
        except MalformedMessage as exc:
            raise RemoteError("internal_error", f"malformed reply to {kind}: {exc}") from None

    def notify(self, message: Message) -> None:
        """Send a message that gets no reply (a report, ended sessions)."""
        self.send_nowait(message.wire())

    def send_nowait(self, message: dict[str, Any]) -> None:
        """Queue one message for writing (the transport buffers; nothing is awaited)."""
        if self._closed:
            raise ChannelClosed("channel is closed")
        try:
            self._writer.writelines(encode_frame_parts(message))
        except (ConnectionError, RuntimeError) as exc:  # one failure type: the peer is gone
            self.close()
            raise ChannelClosed(f"channel write failed: {exc}") from exc

    async def send(self, message: dict[str, Any]) -> None:
        """Write one message and wait for buffer room."""
        self.send_nowait(message)
        try:
            await self._writer.drain()
        except ConnectionError as exc:
            self.close()
            raise ChannelClosed(f"channel write failed: {exc}") from exc

    async def serve(self) -> None:
        """Read until the peer closes; resolve replies, answer pings, queue requests."""
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
                elif kind == Ping.TYPE:
                    pong: dict[str, Any] = {"type": "ok", "id": message.get("id")}
                    if message.get("loop_lag") is True and self.pong is not None:
                        pong.update(self.pong().fields())
                    self.send_nowait(pong)
                else:
                    self._inbox.append(message)
                    if self._dispatcher is None or self._dispatcher.done():
                        self._dispatcher = asyncio.ensure_future(self._dispatch_all())
        except FramingError as exc:
            log.error("coordinator channel dropped: %s", exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.close()

    async def _dispatch_all(self) -> None:
        inbox = self._inbox
        while inbox and not self._closed:
            await self._dispatch(inbox.popleft())

    async def _dispatch(self, payload: dict[str, Any]) -> None:
        request_id = payload.get("id")
        traceparent = payload.get("traceparent")
        token = TRACEPARENT.set(traceparent if isinstance(traceparent, str) else None)
        try:
            reply = await self._handler(decode(payload, self._messages))
        except MalformedMessage as exc:
            reply_msg: dict[str, Any] = {"type": "error", "code": "invalid_request"}
            reply_msg["detail"] = str(exc)
        except GymError as exc:
            reply_msg = {"type": "error", "code": exc.code, "detail": exc.detail}
        except Exception as exc:  # the peer gets the failure as a reply, not a dead channel
            log.exception("handler for %s failed", payload["type"])
            reply_msg = {"type": "error", "code": "internal_error", "detail": repr(exc)}
        else:
            reply_msg = {"type": "ok", **(reply.fields() if reply is not None else {})}
        finally:
            TRACEPARENT.reset(token)
        if request_id is None:
            if reply_msg["type"] == "error":  # a notice has nobody to answer: say it here
                log.error("dropped a %s message: %s", payload["type"], reply_msg["detail"])
            return
        reply_msg["id"] = request_id
        with contextlib.suppress(ChannelClosed):
            self.send_nowait(reply_msg)

    def close(self) -> None:
        """Close the connection and fail every request still waiting for a reply."""
        if self._closed:
            return
        self._closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed("channel closed before the reply"))
        self._pending.clear()
        self._inbox.clear()
        if self._dispatcher is not None and self._dispatcher is not asyncio.current_task():
            self._dispatcher.cancel()
        self._writer.close()
