"""The public side of the data path: one asyncio protocol per client connection.

Requests are parsed with llhttp (httptools). Pipelined requests are answered in order:
only the head of the pipeline talks to a worker; reading pauses while another request
waits, so a client cannot make the proxy buffer more than one read of queued input.
Reading also pauses while the worker side cannot take more body (back-pressure).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

import httptools

from proxy.exchange import Exchange
from proxy.routing import Router, WorkerRoute
from proxy.session_tokens import TokenCodec

__all__ = ["ProxyState", "ClientConnection"]

_PAUSE_PIPELINE = 1
_PAUSE_UPSTREAM = 2


@dataclass(eq=False)
class ProxyState:
    """What every connection of the data path shares."""

    router: Router
    codec: TokenCodec
    control: WorkerRoute
    upstream_timeout: float
    keepalive_timeout: float
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

    # ---- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.state.clients.add(self)
        if self.state.access_log is not None:
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
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(501, "upgrade_not_supported", "protocol upgrades are not proxied")
        except httptools.HttpParserError as exc:
            self._refuse(400, "bad_request", f"malformed HTTP request: {exc}")

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

    def on_url(self, url: bytes) -> None:
        self.parsing.url += url  # type: ignore[union-attr]

    def on_header(self, name: bytes, value: bytes) -> None:
        self.parsing.headers.append((name, value))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        exchange = self.parsing
        parser = self.parser
        exchange.method = parser.get_method()  # type: ignore[union-attr]
        exchange.version = parser.get_http_version()  # type: ignore[union-attr]
        exchange.keep_alive = parser.should_keep_alive()  # type: ignore[union-attr]
        if parser.should_upgrade():
            exchange.error = (501, "upgrade_not_supported", "protocol upgrades are not proxied")  # type: ignore[union-attr]
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
        exchange.request_end()  # type: ignore[union-attr]

    # ---- used by Exchange ---------------------------------------------------------
    def exchange_done(self, exchange: Exchange) -> None:
        """`exchange` wrote its whole response: close, or start the next request."""
        pipeline = self.pipeline
        if pipeline and pipeline[0] is exchange:
            pipeline.popleft()
        if self.closed:
            return
        if exchange.close_after or not exchange.request_done:
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
        """Close after everything written so far has been sent."""
        if not self.closed:
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        """Cut the connection now (a response could not be completed)."""
        if not self.closed:
            self.closed = True
            self.transport.abort()

    # ---- internals ----------------------------------------------------------------
    def _pause(self, reason: int) -> None:
        if not self.read_pause and not self.closed:
            self.transport.pause_reading()
        self.read_pause |= reason

    def _resume(self, reason: int) -> None:
        if self.read_pause & reason:
            self.read_pause &= ~reason
            if not self.read_pause and not self.closed:
                self.transport.resume_reading()

    def _refuse(self, status: int, code: str, detail: str) -> None:
        """The byte stream is not HTTP we accept: answer once it is our turn, then close."""
        self.broken = True
        self._pause(_PAUSE_PIPELINE)
        current = self.parsing
        if current is not None and current in self.pipeline:
            current.keep_alive = False
            current.request_done = True
            if current is not self.pipeline[0]:
                current.error = (status, code, detail)
            elif current.response_started:
                self.abort()  # the broken request is the one being answered
            else:
                current.fail(status, code, detail)
            return
        exchange = Exchange(self)
        exchange.request_done = True
        exchange.keep_alive = False
        exchange.error = (status, code, detail)
        self.pipeline.append(exchange)
        if len(self.pipeline) == 1:
            exchange.start()
