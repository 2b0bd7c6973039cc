"""The `--metrics` listener: `GET /metrics` over HTTP/1.1, every connection bounded.

A small protocol of its own (llhttp through httptools, as the data path's) rather than
aiohttp's server, which caps neither the connections it holds nor how long a request
head may take: idle or half-sent connections to this port would otherwise take the
descriptors the data path's `--max-connections` counts on (proxy.descriptor_budget).

- At most `max_connections` are open (METRICS_CONNECTIONS): one more is answered 503
  `too_many_connections` at once and closed.
- A request, head and any body, is at most MAX_REQUEST bytes (431 for a longer head, 413
  for a body) and must arrive within the header timeout of its first byte, or of the
  connection's start: 408 `request_timeout`, or a silent close if nothing came.
- A connection idle between requests is closed after the keep-alive timeout (and one
  whose client stopped reading its answer is cut then).
- One request at a time: reading pauses while a scrape renders. A request pipelined
  behind another in the same read is not answered; the connection closes after the
  first answer (RFC 9112 9.3.2: the client retries it).
- `GET` or `HEAD` of `/metrics`, and of the pages it is given beside it (the status page,
  `proxy.metrics.status_page`): another path is 404, another method 405. A page marked
  `guarded` needs `Authorization: Bearer <the control token>` (401 otherwise), checked
  as the control calls check it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final

import httptools
from prometheus_client import CONTENT_TYPE_LATEST

from gym_proxy.proxy.data_path.http_wire import error_response
from gym_proxy.proxy.descriptor_budget import METRICS_CONNECTIONS

__all__ = ["MetricsListener", "Page", "bind", "MAX_REQUEST", "HEADER_TIMEOUT"]

log = logging.getLogger("gym_proxy.metrics")

MAX_REQUEST: Final = 8192  # bytes; a scrape's request is about 200
HEADER_TIMEOUT: Final = 10.0  # seconds, when --header-timeout is 0: this port always has one
_PATH = b"/metrics"
_HEAD_OK = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n"

Render = Callable[[], Awaitable[bytes]]


@dataclass(frozen=True)
class Page:
    """A path served beside /metrics: its content type, its body, and whether the control
    token is needed to read it (`guarded`, with `token` the one expected)."""

    content_type: bytes
    render: Render
    guarded: bool = False
    token: bytes = b""

    def allows(self, authorization: bytes) -> bool:
        if not self.guarded:
            return True
        scheme, _, credential = authorization.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), self.token)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on exactly the address given (--metrics)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _Pipelined(Exception):
    """A second request began in a read: it is not parsed."""


class MetricsListener:
    """Serves `render()` at `/metrics` on a listening socket until closed."""

    def __init__(
        self,
        render: Render,
        header_timeout: float,
        keepalive_timeout: float,
        max_connections: int = METRICS_CONNECTIONS,
        pages: Mapping[bytes, Page] | None = None,
    ) -> None:
        self.pages = {_PATH: Page(CONTENT_TYPE_LATEST.encode(), render), **(pages or {})}
        self.render = render
        self.header_timeout = header_timeout or HEADER_TIMEOUT
        self.keepalive_timeout = keepalive_timeout
        self.max_connections = max_connections
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock)

    async def close(self) -> None:
        """Stop listening; cut every connection and wait for their answers to end."""
        if self._server is not None:
            self._server.close()
        tasks = [c.task for c in self.connections if c.task is not None]
        for connection in list(self.connections):
            connection.abort()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class _Connection(asyncio.Protocol):
    """One connection to the metrics port; see the module docstring for its bounds."""

    def __init__(self, listener: MetricsListener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.idle = False  # between requests: the keep-alive timeout runs
        self.received = 0  # bytes of the request being read
        self.url = b""
        self.method = b""
        self.authorization = b""
        self.keep_alive = True
        self.complete = False  # a whole request was read: nothing more is parsed
        self.close_after = False

    # ---- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        listener = self.listener
        if len(listener.connections) >= listener.max_connections:
            detail = "the metrics port is at its connection cap"
            self.transport.write(error_response("too_many_connections", detail, close=True))
            self.transport.close()
            return
        listener.connections.add(self)
        self._arm(listener.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.connections.discard(self)
        self._disarm()
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        if self.complete or self.transport.is_closing():
            return
        if self.idle:
            self.idle = False  # a request begins: the header timeout runs from here
            self._arm(self.listener.header_timeout, self._head_timed_out)
        self.received += len(data)
        if self.received > MAX_REQUEST:
            code = "request_too_large" if self.method else "headers_too_large"
            self._answer_error(code, "the request is larger than a scrape's")
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if not self.complete:  # CONNECT
                self._answer_error("upgrade_not_supported", "nothing is tunnelled here")
            self.close_after = True  # an Upgrade is ignored: answered, then closed
        except httptools.HttpParserCallbackError:
            self.close_after = True  # _Pipelined: answered, then closed
        except httptools.HttpParserError as exc:
            if not self.complete:
                self._answer_error("bad_request", f"malformed HTTP request: {exc}")
            self.close_after = True

    # ---- httptools callbacks ------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:
            raise _Pipelined

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self.authorization = value

    def on_headers_complete(self) -> None:
        self.method = self.parser.get_method()
        self.keep_alive = self.parser.should_keep_alive()

    def on_message_complete(self) -> None:
        self._disarm()
        self.complete = True
        self.transport.pause_reading()
        self.task = asyncio.get_running_loop().create_task(self._answer())

    # ---- internals ----------------------------------------------------------------
    async def _answer(self) -> None:
        head_only = self.method == b"HEAD"
        path = self.url.partition(b"?")[0]
        page = self.listener.pages.get(path)
        where = path.decode("latin-1")
        if page is None:
            served = ", ".join(p.decode() for p in self.listener.pages)
            self._write_error("not_found", f"only {served} is served here", head_only)
        elif self.method not in (b"GET", b"HEAD"):
            self._write_error("method_not_allowed", f"{where} answers GET", head_only)
        elif not page.allows(self.authorization):
            self._write_error("unauthorized", "a valid bearer token is required", head_only)
        else:
            try:
                body = await page.render()
            except Exception:
                log.exception("rendering %s failed", where)
                self._write_error("internal_error", f"rendering {where} failed", head_only)
            else:
                close = b"" if self._keeps() else b"connection: close\r\n"
                head = _HEAD_OK % (page.content_type, len(body), close)
                self.transport.write(head if head_only else head + body)
        self._next()

    def _keeps(self) -> bool:
        return self.keep_alive and not self.close_after

    def _write_error(self, code: str, detail: str, head_only: bool = False) -> None:
        response = error_response(code, detail, close=not self._keeps(), head_only=head_only)
        self.transport.write(response)

    def _next(self) -> None:
        """The answer is written: wait for the next request, or close."""
        self.task = None
        if self.transport.is_closing():
            return
        if not self._keeps():
            self.transport.close()
            return
        self.complete = False
        self.idle = True
        self.received = 0
        self.url = self.method = self.authorization = b""
        self._arm(self.listener.keepalive_timeout, self._idle_timed_out)
        self.transport.resume_reading()

    def _answer_error(self, code: str, detail: str) -> None:
        """Answer what cannot be a scrape and close (no later byte is read)."""
        self._disarm()
        self.complete = self.close_after = True
        self._write_error(code, detail)
        self.transport.close()

    def _head_timed_out(self) -> None:
        self.timer = None
        if self.received:
            self._answer_error("request_timeout", "the request did not arrive in time")
        else:
            self.transport.close()  # not one byte came: nothing to answer

    def _idle_timed_out(self) -> None:
        self.timer = None
        if self.transport.get_write_buffer_size():
            self.abort()  # the client stopped reading its answer
        else:
            self.transport.close()

    def abort(self) -> None:
        self._disarm()
        if self.task is not None:
            self.task.cancel()
        self.transport.abort()

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(delay, callback)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
