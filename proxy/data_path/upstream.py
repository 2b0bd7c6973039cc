"""Keep-alive connections from the proxy to one worker's Unix socket.

An `UpstreamConnection` parses the worker's responses with llhttp (httptools) and hands
each event to the exchange attached to it; between exchanges it sits in its pool's idle
stack. The pool closes idle connections before the worker would (the worker's keep-alive
timeout is longer), so a reused connection is never one the worker is closing.

A worker may answer before it read the whole request body (a 400 for a bad head, a 413)
and close. Our next body write then fails (EPIPE) and the transport drops the socket
unread, with the worker's answer still in its receive queue. So while an exchange may
still write after its first write (a body that streams in, or one too large to go out
at once) its connection keeps a duplicate of its descriptor (`keep_spare`); when the
connection is lost under an unanswered exchange, whatever the worker sent is read from
the duplicate and relayed, instead of a 502. Only such exchanges pay the descriptor: a
request sent whole in one write cannot meet a closed worker on a later write.

A connection goes back to the pool only when both directions ended exactly at a message
boundary. The request side is the exchange's to judge (`Exchange.request_at_boundary`);
this side is: the final response's message ended, the worker allows keep-alive, and not
one byte followed the message end in the same read (llhttp would go on parsing those
bytes as the next response, which the next exchange would then inherit). So the end of a
response is acted on after the whole read is parsed, never from inside the parser.

A response to HEAD announces a body it does not send, and httptools cannot be told the
request was a HEAD; so after its head the parser is replaced by a fresh one, and the
connection is closed, never reused: aiohttp sends the body a handler writes to a
`StreamResponse` even for a HEAD, sometimes in a later read, which the next request
on the connection would take for its answer (a 502). After a 101 the parser is left
behind and bytes go to the exchange untouched (a tunnel).

A burst of new connections can fill a worker's accept queue; a Unix socket then refuses
with EAGAIN at once. Such a connect is retried with a short backoff for up to
`CONNECT_RETRY_SECONDS` instead of failing the request (workers listen with a deep
backlog too).

A pool may have a `limit` (the control app's: proxy.descriptor_budget): connections
open or connecting never exceed it, and an exchange that finds none free waits in line,
in order, for one to be released or closed. Worker pools have none: the connections
they have in use are bounded by the client connections, one in flight each.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final

import httptools

from gym_proxy.proxy.data_path import outbox
from gym_proxy.proxy.data_path.exchange import HANDOVER, RESPONDING
from gym_proxy.proxy.data_path.outbox import Outbox
from gym_proxy.proxy.data_path.spent_parsers import SPENT_RESPONSE_PARSER

if TYPE_CHECKING:
    from gym_proxy.proxy.data_path.exchange import Exchange

__all__ = ["UpstreamConnection", "UpstreamPool", "Connector"]

CONNECT_RETRY_FIRST: Final = 0.002  # seconds; doubling up to 0.1
CONNECT_RETRY_SECONDS: Final = 5.0  # how long a full accept queue is waited out

# Opens a connection to a worker socket for a protocol (tests pass their own).
Connector = Callable[[Callable[[], "UpstreamConnection"], str], Awaitable["UpstreamConnection"]]


class UpstreamConnection(asyncio.Protocol):
    """One connection to a worker; carries at most one exchange at a time."""

    __slots__ = (
        "pool",
        "transport",
        "outbox",
        "parser",
        "exchange",
        "closed",
        "write_paused",
        "read_paused",
        "last_active",
        "headers",
        "spare_fd",
        "bodiless",
        "ended",
        "spoiled",
        "tunnel",
        "counted",
        "pooled",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.outbox: Outbox = None  # type: ignore[assignment]
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.closed = False
        self.write_paused = False
        self.read_paused = False
        self.last_active = 0.0
        # No on_message_begin/on_status callbacks: fewer calls per response (the reason
        # phrase is the standard one for the status; RFC 9112 gives it no meaning).
        self.headers: list[tuple[bytes, bytes]] = []
        self.spare_fd = -1
        self.bodiless = False  # the head of a HEAD response ended in this read
        self.ended = False  # the final response's message ended in this read
        self.spoiled = False  # ... and bytes followed its end
        self.tunnel = False  # after a 101: no more HTTP on this connection
        self.counted = False  # in its pool's `open` count (a pool with a limit)
        self.pooled = False  # idle, in its pool's `idle` list

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.outbox = Outbox(transport)  # type: ignore[arg-type]

    def keep_spare(self) -> None:
        """The exchange will write again after its first write: keep a duplicate of the
        descriptor to read an early answer from should such a write fail."""
        if self.spare_fd < 0 and not self.closed:
            sock = self.transport.get_extra_info("socket")  # type: ignore[union-attr]
            if sock is not None:
                with contextlib.suppress(OSError):  # best effort: out of descriptors
                    self.spare_fd = os.dup(sock.fileno())

    def drop_spare(self) -> None:
        if self.spare_fd >= 0:
            os.close(self.spare_fd)
            self.spare_fd = -1

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            # A worker must not speak unasked; whatever this is, the connection is spoiled.
            self.close()
            return
        self.last_active = exchange.client.proxy_state.now
        outbox.hold()
        try:
            if self.tunnel:
                exchange.response_body(data)
            else:
                self._parse(data)
        finally:
            outbox.release()

    def _parse(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self.tunnel = True
            rest = data[exc.args[0] :] if exc.args else b""
            if rest and self.exchange is not None:
                self.exchange.response_body(rest)
            return
        except httptools.HttpParserError as exc:
            if self.exchange is not None:
                self.exchange.upstream_failed(exc, protocol_error=True)
            self.close()
            return
        if self.bodiless:
            self.bodiless = False
            self.parser = httptools.HttpResponseParser(self)  # it waits for a body
            self.ended = True
        if self.ended:
            self._response_ended()

    def _response_ended(self) -> None:
        """The final response ended in the read just parsed: finish its exchange, and
        let the connection be reused only if nothing followed the end."""
        self.ended = False
        spoiled, self.spoiled = self.spoiled, False
        exchange = self.exchange
        if exchange is not None:
            exchange.response_end(reusable=not spoiled)
        if spoiled:
            self.close()  # never parse those bytes as the answer to the next request

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.spare_fd >= 0:
            if exc is not None and self.exchange is not None:
                self._read_what_is_left()
            self.drop_spare()
        exchange = self.exchange
        if exchange is not None:
            self.exchange = None
            exchange.upstream_lost(exc)
        self.parser = SPENT_RESPONSE_PARSER  # no cycle through its callbacks (spent_parsers)

    def _read_what_is_left(self) -> None:
        """Feed the parser what the worker sent before the connection failed."""
        with contextlib.suppress(OSError, httptools.HttpParserError):
            while self.exchange is not None and not self.exchange.finished:
                data = os.read(self.spare_fd, 65536)  # non-blocking, like the original
                if not data:
                    return
                self.parser.feed_data(data)
        if self.ended:
            self._response_ended()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.exchange is not None:
            self.exchange.client.pause_reading_for_upstream()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.exchange is not None:
            self.exchange.client.resume_reading_for_upstream()

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.ended or self.bodiless:
            self.spoiled = True  # a message after the final one: the stream is out of step

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        exchange = self.exchange
        if exchange is not None and not self.spoiled:
            status = self.parser.get_status_code()
            if exchange.method == b"HEAD" and status >= 200:
                self.bodiless = True
                # Never reused: aiohttp sends a StreamResponse's body to a HEAD anyway, and
                # in a read of its own it would be taken for the next request's answer.
                self.spoiled = True
            exchange.response_head(status, self.headers, self.parser.should_keep_alive())
        self.headers = []

    def on_body(self, body: bytes) -> None:
        if self.bodiless or self.ended:
            self.spoiled = True  # bytes after a HEAD response's head: not a body
            return
        exchange = self.exchange
        if exchange is not None:
            exchange.response_body(body)

    def on_message_complete(self) -> None:
        if self.bodiless or self.ended:
            return  # a "body" to a HEAD, or a second message: spoiled already
        exchange = self.exchange
        if exchange is not None and (exchange.state == RESPONDING or exchange.state == HANDOVER):
            self.ended = True  # acted on once the whole read is parsed (_parse)

    # flow control and lifecycle
    def pause_reading(self) -> None:
        if not self.read_paused and not self.closed:
            self.read_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def resume_reading(self) -> None:
        if self.read_paused and not self.closed:
            self.read_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    def close(self) -> None:
        """Drop the connection now (the worker sees the client go away)."""
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.outbox is not None:
                self.outbox.abort()


class UpstreamPool:
    """Idle keep-alive connections to one worker socket, plus connection setup."""

    def __init__(
        self,
        address: str,
        max_idle: int = 512,
        connect: Connector | None = None,
        limit: int = 0,
    ) -> None:
        self.address = address
        self.max_idle = max_idle
        self.connect: Connector = connect or _connect_unix
        # Idle connections, most recently used last; each knows whether it is here
        # (`pooled`) and since when (its `last_active`, the coarse clock of its last read).
        self.idle: list[UpstreamConnection] = []
        self.connecting: dict[asyncio.Task[None], Exchange] = {}
        self.closed = False
        self.connect_errors = 0  # for /metrics
        self.limit = limit  # most connections open or connecting at once (0: no limit)
        self.open = 0  # ... counted only with a limit
        self.waiting: deque[Exchange] = deque()  # for a connection, at the limit
        self._wake_soon = False

    def acquire(self, exchange: Exchange) -> None:
        """Attach `exchange` to an idle connection now, or to a new one when it connects."""
        idle = self.idle
        while idle:
            conn = idle.pop()
            conn.pooled = False
            if not conn.closed:
                exchange.attach(conn)
                return
        if self.closed:
            exchange.upstream_failed(ConnectionRefusedError("worker is gone"))
            return
        if self.limit:
            if self.open >= self.limit:
                self.waiting.append(exchange)
                return
            self.open += 1
        task = asyncio.get_running_loop().create_task(self._connect(exchange))
        self.connecting[task] = exchange
        task.add_done_callback(self._connected)

    async def _connect(self, exchange: Exchange) -> None:
        delay = CONNECT_RETRY_FIRST
        give_up = time.monotonic() + CONNECT_RETRY_SECONDS
        while True:
            try:
                conn = await self.connect(lambda: UpstreamConnection(self), self.address)
                break
            except BlockingIOError as exc:
                # A full accept queue (a burst of new connections): a Unix socket
                # refuses with EAGAIN instead of queueing the SYN as TCP would. Wait
                # for the worker to accept, briefly, rather than fail the request.
                if exchange.finished or time.monotonic() + delay > give_up:
                    self.connect_errors += 1
                    self._uncount()
                    exchange.upstream_failed(exc)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.1)
            except OSError as exc:
                self.connect_errors += 1
                self._uncount()
                exchange.upstream_failed(exc)
                return
            except asyncio.CancelledError:
                self._uncount()
                raise
        if self.limit:
            conn.counted = True
        if exchange.finished:
            self.release(conn)
            return
        outbox.hold()  # the head and any body that arrived meanwhile: one write
        try:
            exchange.attach(conn)
        finally:
            outbox.release()

    def _connected(self, task: asyncio.Task[None]) -> None:
        self.connecting.pop(task, None)

    def release(self, conn: UpstreamConnection) -> None:
        """Return a connection whose exchange completed cleanly."""
        conn.exchange = None
        conn.drop_spare()
        if conn.closed:
            return
        if self.closed or len(self.idle) >= self.max_idle:
            conn.close()
            return
        if conn.read_paused:
            conn.resume_reading()
        conn.pooled = True
        self.idle.append(conn)
        if self.waiting:
            self._wake()

    def forget(self, conn: UpstreamConnection) -> None:
        """A connection closed: make sure it is never handed out again."""
        if conn.counted:
            conn.counted = False
            self._uncount()
        if conn.pooled:
            conn.pooled = False
            self.idle.remove(conn)

    def close_idle(self, older_than: float) -> None:
        """Close idle connections unused since before `older_than` (the coarse clock,
        `ProxyState.now`: the loop's time)."""
        for conn in list(self.idle):
            if conn.last_active < older_than:
                conn.close()

    def close(self) -> None:
        """The worker is gone: close every idle connection and refuse new ones."""
        self.closed = True
        # Tell the waiting exchanges here: a task cancelled before its first step never
        # runs its own code, and its exchange would wait forever.
        for task, exchange in list(self.connecting.items()):
            task.cancel()
            exchange.upstream_failed(ConnectionAbortedError("worker is gone"))
        self.connecting.clear()
        waiting, self.waiting = self.waiting, deque()
        for exchange in waiting:
            exchange.upstream_failed(ConnectionAbortedError("worker is gone"))
        for conn in list(self.idle):
            conn.close()

    def _uncount(self) -> None:
        """A connection of a pool with a limit closed, or never opened."""
        if self.limit:
            self.open -= 1
            if self.waiting:
                self._wake()

    def _wake(self) -> None:
        # Soon, not now: this runs inside another exchange's ending, or a connection's.
        if not self._wake_soon:
            self._wake_soon = True
            asyncio.get_running_loop().call_soon(self._serve_waiting)

    def _serve_waiting(self) -> None:
        """Hand idle connections, then room for new ones, to exchanges in line."""
        self._wake_soon = False
        waiting = self.waiting
        while waiting and not self.closed and (self.idle or self.open < self.limit):
            exchange = waiting.popleft()
            if not exchange.finished:
                self.acquire(exchange)


async def _connect_unix(factory: Callable[[], UpstreamConnection], path: str) -> UpstreamConnection:
    _, conn = await asyncio.get_running_loop().create_unix_connection(factory, path)
    return conn
