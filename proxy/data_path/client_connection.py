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

Connection phases (`ClientConnection.phase`; each exchange has its own, `proxy.data_path.exchange`):

    READING     parsing requests; the head of the pipeline talks to a worker
    DISCARDING  the answer went out before the request body ended: the rest of the body
                is read and dropped, then the connection closes
    UPGRADING   an upgrade request (WebSocket) was parsed; later input is held, reading
                paused, until the worker answers
    TUNNEL      the worker answered 101: bytes pass both ways untouched until either
                side closes or the tunnel idle timeout
    REFUSED     the input is not parsed any more (not HTTP we accept, over the
                connection cap, a refused upgrade); the answer goes out, then LINGERING
    LINGERING   answered and half-closed; input is dropped until EOF (or LINGER seconds)
    CLOSED      the transport is closed or closing

Transitions (`TRANSITIONS` below, consulted on every change: `proxy.state_tables`; a test
checks this drawing against it):

    READING    --answer before the body ended--> DISCARDING --body end--> REFUSED
    READING    --upgrade request parsed--------> UPGRADING --101--> TUNNEL
    UPGRADING  --any other answer--------------> REFUSED (answered, then closed)
    READING | DISCARDING --bad input / head limits / over the cap--> REFUSED
    REFUSED    --answered, half-closed---------> LINGERING
    READING | DISCARDING | UPGRADING | TUNNEL | REFUSED | LINGERING --close--> CLOSED

Every write goes through the connection's `Outbox`; a read is handled between
`outbox.hold()` and `outbox.release()`, so what one read causes goes out as one write.

Reads land in the shared read buffer (`proxy.data_path.read_buffer`; the connection is
a `BufferedProtocol`). A read that holds more than PASS_BODY_AFTER bytes from a
request's start has the head alone fed to the parser; a Content-Length body then goes
to the worker as views of the buffer, counted down here, and a new parser takes the
next request. llhttp has accepted the head and its one Content-Length by then, so the
body ends where llhttp's would: the worker still gets exactly the request llhttp parsed.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

import httptools

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.proxy.data_path import outbox, read_buffer
from gym_proxy.proxy.data_path.exchange import ANSWERING, RESPONDING, Exchange
from gym_proxy.proxy.data_path.exchange import TUNNEL as EXCHANGE_TUNNEL
from gym_proxy.proxy.data_path.outbox import Outbox
from gym_proxy.proxy.data_path.routing import Router, WorkerRoute
from gym_proxy.proxy.data_path.session_tokens import TokenCodec
from gym_proxy.proxy.data_path.spent_parsers import SPENT_REQUEST_PARSER
from gym_proxy.proxy.state_tables import masks, wrong_transition

__all__ = [
    "RequestTracer",
    "ProxyState",
    "ClientConnection",
    "ClientFactory",
    "close_idle_clients",
    "READING",
    "DISCARDING",
    "UPGRADING",
    "TUNNEL",
    "REFUSED",
    "LINGERING",
    "CLOSED",
    "PHASE_NAMES",
    "TRANSITIONS",
]

# Ordered: a phase >= REFUSED parses nothing more, >= LINGERING writes nothing more.
# Final: the compiled data path (setup.py) inlines them instead of looking them up.
READING: Final = 0
DISCARDING: Final = 1
UPGRADING: Final = 2
TUNNEL: Final = 3
REFUSED: Final = 4
LINGERING: Final = 5
CLOSED: Final = 6
PHASE_NAMES: Final = (
    "reading",
    "discarding",
    "upgrading",
    "tunnel",
    "refused",
    "lingering",
    "closed",
)
TRANSITIONS: Final[dict[int, tuple[int, ...]]] = {
    READING: (DISCARDING, UPGRADING, REFUSED, CLOSED),
    DISCARDING: (REFUSED, CLOSED),
    UPGRADING: (TUNNEL, REFUSED, CLOSED),
    TUNNEL: (CLOSED,),
    REFUSED: (LINGERING, CLOSED),
    LINGERING: (CLOSED,),
    CLOSED: (),
}
_NEXT: Final = masks(TRANSITIONS, len(PHASE_NAMES))

_PAUSE_PIPELINE: Final = 1
_PAUSE_UPSTREAM: Final = 2
_PAUSE_UPGRADE: Final = 4
_HEAD_DETAIL: Final = "the request header block is too large"
# A read with more than this after a request's start has its body passed (_parse): below
# it the parser's copy costs less than a second feed and a new parser.
PASS_BODY_AFTER: Final = 8192
IDLE_CLOSE_BATCH: Final = 32  # at most this many idle connections closed per scan at the cap


def close_idle_clients(state: ProxyState) -> int:
    """At the connection cap: close a few keep-alive connections waiting between
    requests, longest idle first, and say how many (nginx reuses its idle keep-alive
    connections the same way when it runs out). Pooled clients open more connections
    than they use at once after a burst; a new client should not be refused for them.
    One scan makes room for up to 1/256 of the cap (at most 32)."""
    count = max(1, min(IDLE_CLOSE_BATCH, state.max_connections // 256))
    idle = [client for client in state.clients if client.between_requests]
    for client in heapq.nsmallest(count, idle, key=_last_active):
        client.close()
    return min(count, len(idle))


def _last_active(client: ClientConnection) -> float:
    return client.last_active


def _request_line_version(read: bytearray, at: int, method: bytes, url: bytes) -> str:
    """The version of the request line at `at` of `read`, when it is one of the two the
    proxy serves and the line is `method SP url SP HTTP/1.x CRLF` ("" otherwise: then the
    parser is asked). llhttp accepted that line, so this is the version it parsed: a line
    ends at its first LF, so "HTTP/1.x" CRLF found where this line would end it is the
    line's end. One slice and a compare: the parser's version string is formatted anew on
    every request, and bytearray.find/startswith parse their arguments the slow way (5% of
    a GET's instructions either way)."""
    p = at + len(method) + len(url) + 2  # where "HTTP/" starts
    line = read[p : p + 10]
    if line == b"HTTP/1.1\r\n":
        return "1.1"
    if line == b"HTTP/1.0\r\n":
        return "1.0"
    return ""


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int:
    """The body length a head llhttp accepted declares (0 when chunked or none).
    Read here, not taken from the forwarded head: a pipelined request's head is only
    rewritten when it reaches the pipeline's front, and this runs on long reads only."""
    length = 0
    for name, value in headers:
        size = len(name)
        if size == 14 and name.lower() == b"content-length":
            length = int(value)  # llhttp checked: digits only, exactly one
        elif size == 17 and name.lower() == b"transfer-encoding":
            return 0
    return length


class _Discarded(Exception):
    """Raised from a parser callback: the rest of the input is not to be parsed."""


class RequestTracer(Protocol):
    """What the exchange calls at a request's start and end with `--trace-requests`
    (`proxy.metrics.request_spans.RequestSpans`): the data path knows its tracer only as
    this, so that it imports nothing of the metrics, which read the data path."""

    def begin(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> object: ...

    def end(self, span: object, status: int, slot: int) -> None: ...


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
    tunnel_idle_timeout: float = 600.0
    cookie_name: bytes = b"gym_proxy"  # this instance's session cookie
    clients: set[ClientConnection] = field(default_factory=set)
    now: float = 0.0  # coarse clock, advanced by the proxy's sweeper
    clock: Callable[[], float] = time.monotonic  # the exact one (the server's: its loop's)
    draining: bool = False
    # Until every worker has registered, requests other than control calls are answered
    # 503 worker_unavailable (only on an inherited socket, which serves from the start;
    # a port the proxy bound itself listens once they have: proxy.server).
    booting: bool = False
    drained: asyncio.Event | None = None  # set when draining and the last client closed
    access_log: logging.Logger | None = None  # None: no per-request logging at all
    request_spans: RequestTracer | None = None  # with --trace-requests
    token_prefix: bytes = field(init=False, default=b"")  # how the codec's tokens start
    # Counted for /metrics: the proxy's own answers by error code, and responses cut
    # short after their first byte (a worker that died mid-answer).
    errors: dict[str, int] = field(default_factory=dict)
    responses_cut: int = 0

    def __post_init__(self) -> None:
        self.token_prefix = self.codec.prefix.encode()


class ClientConnection(asyncio.BufferedProtocol):
    """One client connection; see the module docstring for the phases and flow rules."""

    __slots__ = (
        "proxy_state",
        "transport",
        "outbox",
        "parser",
        "phase",
        "parsing",
        "pipeline",
        "read_pause",
        "write_paused",
        "last_active",
        "peer",
        "in_head",
        "head_since",
        "head_bytes",
        "head_marks",
        "held",
        "line_at",
        "body_left",
    )

    def __init__(self, proxy_state: ProxyState) -> None:
        self.proxy_state = proxy_state
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.outbox: Outbox = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.phase = READING
        self.parsing: Exchange | None = None
        self.pipeline: deque[Exchange] = deque()
        self.read_pause = 0
        self.write_paused = False
        self.last_active = proxy_state.now
        self.peer = "-"
        self.in_head = True  # between messages or inside a head (not inside a body)
        # When the head being waited for began: by the exact clock, not the coarse one, which
        # may lag by a sweep interval, as long as a short --header-timeout.
        self.head_since: float | None = proxy_state.clock()
        self.head_bytes = 0  # bytes of the current head seen so far (a lower bound)
        self.head_marks = 0  # message boundaries seen, to tell reads inside one head
        self.held = b""  # input after an upgrade request, for the tunnel
        # While a part of a read is parsed: where the part begins in the read buffer, when
        # its first line is the request line of the first request it completes (else -1),
        # for `_request_line_version`.
        self.line_at = -1
        # Bytes of the current request's body still to come that the parser is not fed:
        # a Content-Length body behind a head that came with more than PASS_BODY_AFTER
        # bytes goes on as views of the read (module docstring).
        self.body_left = 0

    @property
    def between_requests(self) -> bool:
        """A keep-alive connection waiting, with no byte of a next request yet."""
        return (
            self.phase == READING
            and self.parsing is None
            and self.head_since is None
            and not self.pipeline
        )

    def _to(self, new: int) -> None:
        """The one way the phase changes: by the table (module docstring)."""
        old = self.phase
        if not (_NEXT[old] >> new) & 1:
            wrong_transition("client connection", PHASE_NAMES, old, new)
        self.phase = new

    @property
    def closed(self) -> bool:
        """Nothing more is written (the transport is closed, or lingering)."""
        return self.phase >= LINGERING

    # ---- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.outbox = Outbox(transport)  # type: ignore[arg-type]
        state = self.proxy_state
        if len(state.clients) >= state.max_connections and not close_idle_clients(state):
            # Over the cap and nothing idle to close: answer the first request 503 and
            # close, so descriptors are given back at once instead of running out.
            self._to(REFUSED)
            self._answer_and_close("too_many_connections", "the proxy is at --max-connections")
        state.clients.add(self)
        if state.access_log is not None:
            peer = transport.get_extra_info("peername")
            self.peer = str(peer[0]) if isinstance(peer, tuple) else str(peer or "-")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.phase != CLOSED:
            self._to(CLOSED)
        self.outbox.closed = True
        state = self.proxy_state
        state.clients.discard(self)
        if state.drained is not None and not state.clients:
            state.drained.set()
        for exchange in self.pipeline:
            exchange.abort()
        self.pipeline.clear()
        if self.parsing is not None:
            self.parsing.abort()
            self.parsing = None
        self.parser = SPENT_REQUEST_PARSER  # no cycle through its callbacks (spent_parsers)

    def get_buffer(self, sizehint: int) -> memoryview:
        return read_buffer.READ.view

    def data_received(self, data: bytes) -> None:
        """Input handed as bytes, as to a plain Protocol: read into the buffer as a read.
        uvloop hands a BufferedProtocol its buffer instead, but looks this method up on
        every new connection: absent, the lookup raised and caught an AttributeError
        (~3k instructions a connection)."""
        at = 0
        while at < len(data) and self.phase < REFUSED:
            view = self.get_buffer(len(data) - at)
            size = min(len(view), len(data) - at)
            view[:size] = data[at : at + size]
            self.buffer_updated(size)
            at += size

    def buffer_updated(self, nbytes: int) -> None:
        self.last_active = self.proxy_state.now
        phase = self.phase
        if phase >= REFUSED:
            return
        read = read_buffer.READ
        outbox.hold()
        try:
            if phase == TUNNEL:
                self.pipeline[0].request_body(read.view[:nbytes])
            elif phase == UPGRADING:
                self.held += bytes(read.view[:nbytes])  # paused: at most one read arrives here
            else:
                self._parse(read.data, read.view, nbytes)
        finally:
            outbox.release()

    def _parse(self, read: bytearray, view: memoryview, end: int) -> None:
        """Parse `read[:end]`: the parser is fed all of it, but for the bodies it passes."""
        if self.head_since is None and self.in_head:
            self.head_since = self.proxy_state.clock()  # a head begins: its timeout runs
        start = 0
        while start < end and self.phase < REFUSED:
            if self.body_left:
                start = self._pass_body(view, start, end)
                continue
            stop = end
            if self.parsing is None and end - start > PASS_BODY_AFTER:
                # A long read at a request's start: its head alone goes to the parser, so a
                # Content-Length body can go on without it (a view instead of two copies).
                head_end = read.find(b"\r\n\r\n", start, end)
                if head_end >= 0:
                    stop = head_end + 4
            if not self._feed(read, view, start, stop, end):
                return
            if stop < end and self.parsing is not None and not self.in_head:
                self.body_left = _declared_length(self.parsing.headers)
            start = stop

    def _feed(self, read: bytearray, view: memoryview, start: int, stop: int, end: int) -> bool:
        """Feed `read[start:stop]` to the parser; False when parsing this read is over."""
        marks = self.head_marks
        # No request begun before this part: its first line is the next request line.
        if self.parsing is None:
            self.line_at = start
        try:
            self.parser.feed_data(view[start:stop])
        except httptools.HttpParserUpgrade as exc:
            rest = start + exc.args[0] if exc.args else end
            self._upgrading(bytes(view[rest:end]))
            return False
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, _Discarded):
                return False
            if not isinstance(refused, GymError):
                raise
            self._refuse(refused.code, refused.detail)
            return False
        except httptools.HttpParserError as exc:
            self._refuse("bad_request", f"malformed HTTP request: {exc}")
            return False
        finally:
            self.line_at = -1  # never kept past the part
        if self.in_head and marks == self.head_marks and self.parsing is not None:
            # This whole part lay inside one unfinished head (httptools buffers it).
            self.head_bytes += stop - start
            if self.head_bytes > self.proxy_state.limit_request_head and self.phase < REFUSED:
                self._refuse("headers_too_large", _HEAD_DETAIL)
                return False
        return True

    def _pass_body(self, view: memoryview, start: int, end: int) -> int:
        """Send on what `view[start:end]` holds of a body the parser is not fed; at its
        end, the request is complete and a new parser takes the next one. Returns where
        the unread input starts."""
        exchange = self.parsing
        if exchange is None:
            raise AssertionError("a body passed with no request being parsed")
        stop = min(end, start + self.body_left)
        self.body_left -= stop - start
        exchange.request_body(view[start:stop])
        if not self.body_left:
            # The old parser still waits for the body it never saw.
            self.parser = httptools.HttpRequestParser(self)
            try:
                self.on_message_complete()
            except _Discarded:
                return end
        return stop

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
    # No on_message_begin: a request's first callback is on_url (one call fewer each).
    def on_url(self, url: bytes) -> None:
        exchange = self.parsing
        if exchange is None:
            exchange = self.parsing = Exchange(self)
            self.head_marks += 1
            self.head_bytes = 0
            exchange.url = url
        else:
            exchange.url += url
        if len(exchange.url) > self.proxy_state.limit_request_line:
            raise GymError("uri_too_long", "the request line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        exchange: Exchange = self.parsing  # type: ignore[assignment]  # typed: a native list
        exchange.headers.append((name, value))
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > self.proxy_state.limit_request_head:
            raise GymError("headers_too_large", _HEAD_DETAIL)

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_since = None
        self.head_marks += 1
        exchange: Exchange = self.parsing  # type: ignore[assignment]
        parser = self.parser
        exchange.method = parser.get_method()
        line_at = self.line_at
        version = (
            _request_line_version(read_buffer.READ.data, line_at, exchange.method, exchange.url)
            if line_at >= 0
            else ""
        )
        self.line_at = -1  # a later request of the same part: asked of the parser
        exchange.version = version or parser.get_http_version()
        exchange.keep_alive = parser.should_keep_alive()
        if parser.should_upgrade():
            # llhttp stops parsing after this message either way (HttpParserUpgrade).
            exchange.keep_alive = False
            if exchange.method == b"CONNECT":
                exchange.error = ("upgrade_not_supported", "CONNECT is not proxied")
                self._to(REFUSED)  # what follows is not HTTP: answer, then linger
            else:
                exchange.upgrade = True
        self.pipeline.append(exchange)
        if len(self.pipeline) == 1:
            exchange.start()
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
        if self.phase == DISCARDING:
            self._to(REFUSED)
            self.close()
            raise _Discarded  # stop parsing: nothing after this request is served

    # ---- used by Exchange ---------------------------------------------------------
    def exchange_done(self, exchange: Exchange) -> None:
        """`exchange` wrote its whole response: close, or start the next request."""
        pipeline = self.pipeline
        if pipeline and pipeline[0] is exchange:
            pipeline.popleft()
        phase = self.phase
        if phase >= LINGERING:
            return
        if exchange.upgrade and (phase == UPGRADING or phase == TUNNEL):
            if phase == UPGRADING:
                self._to(REFUSED)  # no switch: held input is dropped, then lingering
            self.close()
            return
        if not exchange.request_done:
            if phase == READING:
                self._to(DISCARDING)
            self._resume(_PAUSE_UPSTREAM | _PAUSE_PIPELINE)
            return
        if exchange.close_after:
            self.close()
            return
        # Whatever the exchange paused reading for (a worker connection that never came,
        # a full upstream buffer) no longer applies.
        if self.read_pause:
            self._resume(_PAUSE_UPSTREAM)
        if pipeline:
            pipeline[0].start()
        if self.read_pause and self.phase < LINGERING and len(pipeline) <= 1:
            self._resume(_PAUSE_PIPELINE)

    def start_tunnel(self, exchange: Exchange) -> None:
        """The worker switched protocols: from now on bytes pass through untouched."""
        self._to(TUNNEL)
        held, self.held = self.held, b""
        if held:
            exchange.request_body(held)
        self._resume(_PAUSE_UPGRADE)

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
        if self.phase >= LINGERING:
            return
        if self.phase == REFUSED and self.transport.can_write_eof():
            self._to(LINGERING)
            self.read_pause = 0
            self.transport.resume_reading()
            self.outbox.write_eof()
        else:
            self._to(CLOSED)
            self.outbox.close()

    def abort(self) -> None:
        """Cut the connection now (a response could not be completed)."""
        if self.phase != CLOSED:
            self._to(CLOSED)
            self.outbox.abort()

    def head_timed_out(self) -> None:
        """The head did not arrive within the header timeout (the sweep calls this)."""
        self.head_since = None
        if self.parsing is None and not self.pipeline:
            self.close()  # not one byte of a request: nothing to answer
        elif self.phase < REFUSED:
            self._refuse("request_timeout", "the request head did not arrive in time")

    def tunnel_timed_out(self) -> None:
        """Nothing crossed the tunnel for the tunnel idle timeout (the sweep calls this)."""
        if self.phase == TUNNEL and self.pipeline:
            self.pipeline[0].finish(reuse=False)  # closes both sides

    # ---- internals ----------------------------------------------------------------
    def _upgrading(self, rest: bytes) -> None:
        """llhttp stopped after an upgrade request: hold the input that follows it."""
        if self.phase != READING:
            return  # the request was refused and answered already
        exchange = self.pipeline[-1] if self.pipeline else None
        if exchange is None or not exchange.upgrade:
            self._to(REFUSED)  # CONNECT: answered with its error, then closed
            self._pause(_PAUSE_PIPELINE)
            return
        self._to(UPGRADING)
        self.held = rest
        self._pause(_PAUSE_UPGRADE)

    def _pause(self, reason: int) -> None:
        if not self.read_pause and self.phase < LINGERING:
            self.transport.pause_reading()
        self.read_pause |= reason

    def _resume(self, reason: int) -> None:
        if self.read_pause & reason:
            self.read_pause &= ~reason
            if not self.read_pause and self.phase < LINGERING:
                self.transport.resume_reading()

    def _refuse(self, code: str, detail: str) -> None:
        """The byte stream is not HTTP we accept: answer once it is our turn, then close."""
        self._to(REFUSED)
        self._pause(_PAUSE_PIPELINE)
        current = self.parsing
        if current is not None and current in self.pipeline:
            current.keep_alive = False
            current.request_done = True
            if current is not self.pipeline[0]:
                current.error = (code, detail)
            elif current.state == RESPONDING or current.state == EXCHANGE_TUNNEL:
                self.abort()  # the broken request is the one being answered
            elif current.state == ANSWERING:
                current.error = (code, detail)  # broken bytes outrank a refused head
                current.request_end()
            else:
                current.fail(code, detail)
            return
        self._answer_and_close(code, detail)

    def _answer_and_close(self, code: str, detail: str) -> None:
        """Queue the proxy's own answer behind the pipeline; the connection then closes."""
        exchange = Exchange(self)
        exchange.request_done = True
        exchange.keep_alive = False
        exchange.error = (code, detail)
        self.pipeline.append(exchange)
        if len(self.pipeline) == 1:
            exchange.start()


class ClientFactory:
    """The public listener's protocol factory: compiled (setup.py), where a lambda in
    the server's module would run as Python on every new connection (~1k instructions)."""

    __slots__ = ("state",)

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def __call__(self) -> ClientConnection:
        return ClientConnection(self.state)
