"""The public side of the data path: one asyncio protocol per client connection.

Requests are parsed with llhttp (httptools). Pipelined requests are answered in order:
only the head of the pipeline talks to a worker; reading pauses while another request
waits, so a client cannot make the proxy buffer more than one read of queued input.
Reading also pauses while the worker side cannot take more body (back-pressure).

Heads are bounded: a request line longer than `limit_request_line` is 414, a header
block larger than `limit_request_head` is 431 (both then close). httptools buffers a
header it has not finished whole, so besides the exact count from the callbacks, every
read that lies entirely inside an unfinished head counts too: a header that never ends
is cut off one read past the limit. A head not complete within `header_timeout` of its
first byte (or of the connection's start) is 408, or closed silently if nothing came.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

import httptools

from coordinator.errors import GymError
from proxy.exchange import Exchange
from proxy.routing import Router, WorkerRoute
from proxy.session_tokens import TokenCodec

__all__ = ["ProxyState", "ClientConnection"]

_PAUSE_PIPELINE = 1
_PAUSE_UPSTREAM = 2
_HEAD_DETAIL = "the request header block is too large"


class _Discarded(Exception):
    """Raised from a parser callback: the rest of the input is not to be parsed."""


@dataclass(eq=False)
class ProxyState:
    """What every connection of the data path shares."""

    router: Router
    codec: TokenCodec
    control: WorkerRoute
    upstream_timeout: float
    keepalive_timeout: float
    header_timeout: float = 10.0
    limit_request_line: int = 8190
    limit_request_head: int = 65536
    max_connections: int = 10000
    clients: set[ClientConnection] = field(default_factory=set)
    now: float = 0.0  # coarse clock, advanced by the proxy's sweeper
    draining: bool = False
    drained: asyncio.Event | None = None  # set when draining and the last client closed
    access_log: logging.Logger | None = None  # None: no per-request logging at all


class ClientConnection(asyncio.Protocol):
    """One client connection; see the module docstring for the flow rules."""

    __slots__ = (
        "state",
        "transport",
        "parser",
        "parsing",
        "pipeline",
        "read_pause",
        "write_paused",
        "closed",
        "broken",
        "last_active",
        "peer",
        "in_head",
        "head_since",
        "head_bytes",
        "head_marks",
        "discard_rest",
        "lingering",
    )

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.parsing: Exchange | None = None
        self.pipeline: deque[Exchange] = deque()
        self.read_pause = 0
        self.write_paused = False
        self.closed = False
        self.broken = False
        self.last_active = state.now
        self.peer = "-"
        self.in_head = True  # between messages or inside a head (not inside a body)
        self.head_since: float | None = state.now  # when the head being waited for began
        self.head_bytes = 0  # bytes of the current head seen so far (a lower bound)
        self.head_marks = 0  # message boundaries seen, to tell reads inside one head
        # The worker answered before the request body was all here: read the rest and
        # drop it, then close (closing with unread input would reset the connection and
        # could destroy the answer in the client's receive buffer).
        self.discard_rest = False
        self.lingering = False  # answered and half-closed; dropping input until EOF

    # ---- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        state = self.state
        if len(state.clients) >= state.max_connections:
            # Over the cap: answer the first request 503 and close, so descriptors
            # are given back at once instead of running out for everyone.
            self.broken = True
            self._refuse_connection()
        state.clients.add(self)
        if state.access_log is not None:
            peer = transport.get_extra_info("peername")
            self.peer = str(peer[0]) if isinstance(peer, tuple) else str(peer or "-")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        state = self.state
        state.clients.discard(self)
        if state.drained is not None and not state.clients:
            state.drained.set()
        for exchange in self.pipeline:
            exchange.abort()
        self.pipeline.clear()
        if self.parsing is not None:
            self.parsing.abort()
            self.parsing = None

    def data_received(self, data: bytes) -> None:
        self.last_active = self.state.now
        if self.broken:
            return
        marks = self.head_marks
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse("upgrade_not_supported", "protocol upgrades are not proxied")
            return
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, _Discarded):
                return
            if not isinstance(refused, GymError):
                raise
            self._refuse(refused.code, refused.detail)
            return
        except httptools.HttpParserError as exc:
            self._refuse("bad_request", f"malformed HTTP request: {exc}")
            return
        if self.in_head and marks == self.head_marks and self.parsing is not None:
            # This whole read lay inside one unfinished head (httptools buffers it).
            self.head_bytes += len(data)
            if self.head_bytes > self.state.limit_request_head and not self.broken:
                self._refuse("headers_too_large", _HEAD_DETAIL)

    def eof_received(self) -> bool:
        # Like nginx without proxy_ignore_client_abort: a client that closed its side has
        # gone away, so its in-flight request is cancelled rather than finished for nobody.
        return False

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.pipeline and self.pipeline[0].upstream is not None:
            self.pipeline[0].upstream.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.pipeline and self.pipeline[0].upstream is not None:
            self.pipeline[0].upstream.resume_reading()

    # ---- httptools callbacks ------------------------------------------------------
    def on_message_begin(self) -> None:
        self.parsing = Exchange(self)
        self.head_marks += 1
        self.head_bytes = 0
        if self.head_since is None:
            self.head_since = self.state.now

    def on_url(self, url: bytes) -> None:
        exchange = self.parsing
        exchange.url += url  # type: ignore[union-attr]
        if len(exchange.url) > self.state.limit_request_line:  # type: ignore[union-attr]
            raise GymError("uri_too_long", "the request line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.parsing.headers.append((name, value))  # type: ignore[union-attr]
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > self.state.limit_request_head:
            raise GymError("headers_too_large", _HEAD_DETAIL)

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_since = None
        self.head_marks += 1
        exchange = self.parsing
        parser = self.parser
        exchange.method = parser.get_method()  # type: ignore[union-attr]
        exchange.version = parser.get_http_version()  # type: ignore[union-attr]
        exchange.keep_alive = parser.should_keep_alive()  # type: ignore[union-attr]
        if parser.should_upgrade():
            exchange.error = ("upgrade_not_supported", "protocol upgrades are not proxied")  # type: ignore[union-attr]
            exchange.keep_alive = False  # type: ignore[union-attr]
        self.pipeline.append(exchange)  # type: ignore[arg-type]
        if len(self.pipeline) == 1:
            exchange.start()  # type: ignore[union-attr]
        else:
            self._pause(_PAUSE_PIPELINE)

    def on_body(self, body: bytes) -> None:
        self.parsing.request_body(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        exchange = self.parsing
        self.parsing = None
        self.in_head = True
        self.head_bytes = 0
        self.head_marks += 1
        exchange.request_end()  # type: ignore[union-attr]
        if self.discard_rest:
            self.broken = True
            self.close()
            raise _Discarded  # stop parsing: nothing after this request is served

    # ---- used by Exchange ---------------------------------------------------------
    def exchange_done(self, exchange: Exchange) -> None:
        """`exchange` wrote its whole response: close, or start the next request."""
        pipeline = self.pipeline
        if pipeline and pipeline[0] is exchange:
            pipeline.popleft()
        if self.closed:
            return
        if not exchange.request_done:
            self.discard_rest = True
            self._resume(_PAUSE_UPSTREAM | _PAUSE_PIPELINE)
            return
        if exchange.close_after:
            self.close()
            return
        # Whatever the exchange paused reading for (a worker connection that never came,
        # a full upstream buffer) no longer applies.
        self._resume(_PAUSE_UPSTREAM)
        if pipeline:
            pipeline[0].start()
        if not self.closed and len(pipeline) <= 1:
            self._resume(_PAUSE_PIPELINE)

    def pause_reading_for_upstream(self) -> None:
        self._pause(_PAUSE_UPSTREAM)

    def resume_reading_for_upstream(self) -> None:
        self._resume(_PAUSE_UPSTREAM)

    def close(self) -> None:
        """Close after everything written so far has been sent.

        A connection whose input was refused may still be receiving (a head or body the
        client keeps writing); closing with unread input would reset it and could destroy
        the answer in the client's buffer. So, like nginx's lingering close, it sends FIN
        after the answer and reads and drops input until the client closes (the sweep
        cuts it after LINGER seconds).
        """
        if self.closed:
            return
        self.closed = True
        if self.broken and self.transport.can_write_eof():
            self.lingering = True
            self.read_pause = 0
            self.transport.resume_reading()
            self.transport.write_eof()
        else:
            self.transport.close()

    def abort(self) -> None:
        """Cut the connection now (a response could not be completed)."""
        if not self.closed:
            self.closed = True
            self.transport.abort()

    def head_timed_out(self) -> None:
        """The head did not arrive within the header timeout (the sweep calls this)."""
        self.head_since = None
        if self.parsing is None and not self.pipeline:
            self.close()  # not one byte of a request: nothing to answer
        elif not self.broken:
            self._refuse("request_timeout", "the request head did not arrive in time")

    # ---- internals ----------------------------------------------------------------
    def _refuse_connection(self) -> None:
        exchange = Exchange(self)
        exchange.request_done = True
        exchange.keep_alive = False
        exchange.error = ("too_many_connections", "the proxy is at --max-connections")
        self.pipeline.append(exchange)
        exchange.start()

    def _pause(self, reason: int) -> None:
        if not self.read_pause and not self.closed:
            self.transport.pause_reading()
        self.read_pause |= reason

    def _resume(self, reason: int) -> None:
        if self.read_pause & reason:
            self.read_pause &= ~reason
            if not self.read_pause and not self.closed:
                self.transport.resume_reading()

    def _refuse(self, code: str, detail: str) -> None:
        """The byte stream is not HTTP we accept: answer once it is our turn, then close."""
        self.broken = True
        self._pause(_PAUSE_PIPELINE)
        current = self.parsing
        if current is not None and current in self.pipeline:
            current.keep_alive = False
            current.request_done = True
            if current is not self.pipeline[0]:
                current.error = (code, detail)
            elif current.response_started:
                self.abort()  # the broken request is the one being answered
            else:
                current.fail(code, detail)
            return
        exchange = Exchange(self)
        exchange.request_done = True
        exchange.keep_alive = False
        exchange.error = (code, detail)
        self.pipeline.append(exchange)
        if len(self.pipeline) == 1:
            exchange.start()
