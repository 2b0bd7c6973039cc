"""One request/response pair crossing the proxy.

The client connection feeds request events in, the upstream connection feeds response
events in, and the exchange writes both out with the framing each side needs. Every
failure ends here in one method, `fail`, which maps it to a status code (or cuts the
client connection when a response has already begun).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from coordinator.errors import GymError, status_of
from proxy import http_wire as wire
from proxy.app_tokens import app_token_session
from proxy.request_head import RequestHead, rewrite_request_head
from proxy.routing import WorkerRoute
from proxy.session_tokens import TokenError, is_valid_id
from worker.app_sessions import session_in_headers

if TYPE_CHECKING:
    from proxy.client_connection import ClientConnection
    from proxy.upstream import UpstreamConnection

__all__ = ["Exchange"]

_CONTROL_PREFIX = b"/ng-control/"
_ROLLOUT_PREFIX = b"/ng-rollout/"
_NO_BODY_STATUS = frozenset({204, 304})
# Response headers the proxy acts on; hop-by-hop and worker-only ones never reach clients.
_R_LENGTH, _R_CHUNKED, _R_CONNECTION, _R_DROP, _R_APP_SESSION, _R_APP_END = range(6)
_RESPONSE_KINDS = {
    **dict.fromkeys(wire.HOP_BY_HOP, _R_DROP),
    b"content-length": _R_LENGTH,
    b"transfer-encoding": _R_CHUNKED,
    b"connection": _R_CONNECTION,
    wire.APP_SESSION_HEADER: _R_APP_SESSION,
    wire.APP_SESSION_END_HEADER: _R_APP_END,
}


class Exchange:
    """State of one request from its headers to the end of its response."""

    __slots__ = (
        "client",
        "method",
        "url",
        "headers",
        "version",
        "keep_alive",
        "is_head",
        "request_done",
        "finished",
        "expect_continue",
        "chunked_request",
        "body_buffer",
        "worker",
        "upstream",
        "head",
        "new_token",
        "cookie_token",
        "error",
        "pending_error",
        "response_started",
        "chunked_response",
        "until_eof",
        "upstream_keep_alive",
        "informational",
        "close_after",
        "status",
        "started",
        "routed_at",
    )

    def __init__(self, client: ClientConnection) -> None:
        self.client = client
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.method = b"GET"
        self.version = "1.1"
        self.keep_alive = True
        self.is_head = False
        self.request_done = False
        self.finished = False
        self.expect_continue = False
        self.chunked_request = False
        self.body_buffer: list[bytes] | None = None
        self.worker: WorkerRoute | None = None
        self.upstream: UpstreamConnection | None = None
        self.head = b""
        self.new_token: bytes | None = None
        self.cookie_token: bytes | None = None  # routed by this ng_session cookie
        self.error: tuple[str, str] | None = None  # (code, detail) decided before start
        self.pending_error: tuple[str, str] | None = None
        self.response_started = False
        self.chunked_response = False
        self.until_eof = False
        self.upstream_keep_alive = False
        self.informational = False
        self.close_after = False
        self.status = 0
        self.started = 0.0
        self.routed_at = 0.0  # coarse time the request was sent to a worker

    # ---- request side -------------------------------------------------------------
    def start(self) -> None:
        """Route the request and send it on; called when it heads the pipeline."""
        if self.client.state.access_log is not None:
            self.started = time.perf_counter()
        if self.error is not None:
            self.fail(*self.error)
            return
        self.is_head = self.method == b"HEAD"
        try:
            head = rewrite_request_head(self.method, self.url, self.version, self.headers)
        except GymError as exc:
            self.keep_alive = False
            self.fail(exc.code, exc.detail)
            return
        self.chunked_request = head.chunked
        self.expect_continue = head.expect_continue
        parts = head.parts
        if self.url.startswith(_CONTROL_PREFIX):
            worker: WorkerRoute | None = self.client.state.control
        else:
            worker = self._route_session(parts, head)
            if worker is None:
                return  # answered with an error
        parts += (head.framing(), b"\r\n")
        self.head = b"".join(parts)
        worker.in_flight += 1
        self.worker = worker
        self.routed_at = self.client.state.now
        if self.expect_continue and not self.request_done:
            self.client.transport.write(wire.CONTINUE_100)
        worker.pool.acquire(self)

    def _route_session(self, parts: list[bytes], head: RequestHead) -> WorkerRoute | None:
        """Pick the worker and add the identity headers; None after answering an error."""
        state = self.client.state
        router = state.router
        key = rest = None
        if self.url.startswith(_ROLLOUT_PREFIX):
            key, rest = wire.split_rollout_path(self.url, len(_ROLLOUT_PREFIX))
            if not key:
                self.fail("bad_request", "/ng-rollout/ needs an episode key")
                return None
        app_session = None
        try:
            owner = head.owner_hint.decode("ascii") if head.owner_hint else None
            if owner is not None and not is_valid_id(owner):
                raise TokenError("x-ng-session-owner is not a valid owner ID")
            if head.app_token is not None:
                app_session = app_token_session(head.app_token)
            route = router.route_app_session(app_session) if app_session else None
            if route is None:
                token = head.token
                if token is None and head.cookie is not None:
                    token = wire.cookie_token(head.cookie)
                    if token is None and router.sessions:
                        # Only the app's own session cookie (a client of a restored NeMo
                        # Gym checkpoint): its session decides, if a worker holds it.
                        cookie_session = session_in_headers([(b"cookie", head.cookie)], False)
                        if cookie_session is not None:
                            route = router.route_app_session(cookie_session)
                identity = state.codec.verify(token.decode("ascii")) if token else None
                route = route or router.route(identity, owner)
        except (TokenError, UnicodeDecodeError) as exc:
            self.fail("invalid_session_token", str(exc))
            return None
        except GymError as exc:
            self.fail(exc.code, exc.detail)
            return None
        worker = route.worker
        if key is not None and not worker.keeps_rollout_prefix:
            # aiohttp routes before any middleware: the app sees /rest, the runtime the key.
            parts[2] = rest  # type: ignore[call-overload]
            parts += (b"x-ng-episode-key: ", key, b"\r\n")
        if head.app_token is not None:
            # The app's own token decides; the proxy mints nothing for such a call.
            if app_session is not None:
                parts += (b"x-ng-session-id: ", app_session.encode(), b"\r\n")
            return worker
        token = head.token
        if token is None and head.cookie is not None:
            token = self.cookie_token = wire.cookie_token(head.cookie)
        if route.new:
            token = state.codec.sign(route.session_id, worker.owner).encode()
            self.new_token = token
            parts.append(b"x-ng-session-new: 1\r\n")
        parts += (b"x-ng-session-id: ", route.session_id.encode(), b"\r\n")
        if token is not None:  # None: routed by the app's own session cookie
            parts += (b"x-ng-session-token: ", token, b"\r\n")
        return worker

    def request_body(self, body: bytes) -> None:
        if self.finished or self.pending_error is not None or self.error is not None:
            return  # the answer is already decided; the body is read and dropped
        conn = self.upstream
        if conn is None:
            if self.body_buffer is None:
                self.body_buffer = []
            self.body_buffer.append(body)
            self.client.pause_reading_for_upstream()
            return
        conn.last_active = self.client.state.now
        if self.chunked_request:
            conn.transport.writelines(wire.chunk(body))
        else:
            conn.transport.write(body)

    def request_end(self) -> None:
        self.request_done = True
        if self.finished:
            return
        if self.pending_error is not None:
            self._write_error(*self.pending_error)
            return
        if self.upstream is not None and self.chunked_request:
            self.upstream.transport.write(wire.LAST_CHUNK)

    # ---- upstream side ------------------------------------------------------------
    def attach(self, conn: UpstreamConnection) -> None:
        """Send the request on `conn`, with whatever body arrived while connecting."""
        self.upstream = conn
        conn.exchange = self
        conn.last_active = self.client.state.now
        transport = conn.transport
        transport.write(self.head)
        if self.body_buffer:
            for body in self.body_buffer:
                if self.chunked_request:
                    transport.writelines(wire.chunk(body))
                else:
                    transport.write(body)
            self.body_buffer = None
        if self.request_done and self.chunked_request:
            transport.write(wire.LAST_CHUNK)
        if self.client.write_paused:
            conn.pause_reading()
        if not conn.write_paused:
            self.client.resume_reading_for_upstream()

    def response_head(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], keep_alive: bool
    ) -> None:
        if status < 200:
            self.informational = True  # 1xx: we answered Expect ourselves; drop it
            return
        self.upstream_keep_alive = keep_alive
        self.status = status
        client = self.client
        # A response that starts before the request body ended may end first; the rest of
        # the body is then dropped, and the connection cannot be reused.
        close = not self.keep_alive or not self.request_done or client.state.draining
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason or wire.reason_phrase(status))]
        length_known = upstream_chunked = False
        listed = None
        kinds = _RESPONSE_KINDS
        for name, value in headers:
            kind = kinds.get(name.lower())
            if kind is None:
                parts += (name, b": ", value, b"\r\n")
            elif kind == _R_LENGTH:
                length_known = True
                parts += (name, b": ", value, b"\r\n")
            elif kind == _R_CHUNKED:
                upstream_chunked = True
            elif kind == _R_CONNECTION:
                listed = wire.connection_listed(value)
            elif kind == _R_APP_SESSION:
                self._learn_app_session(value)
            elif kind == _R_APP_END:
                self._forget_app_session(value)
        if listed:
            parts = wire.without_headers(parts, 1, listed)
        if self.new_token is not None:
            parts.append(wire.set_cookie_headers(self.new_token))
        elif self.cookie_token is not None:
            # Re-set on every answer, as Starlette does its session cookie: NeMo Gym's
            # clients send on only the cookies of the last response they got.
            parts.append(wire.refresh_cookie_header(self.cookie_token))
        no_body = self.is_head or status in _NO_BODY_STATUS
        if not no_body and not length_known:
            self.until_eof = not upstream_chunked
            if self.version != "1.0":
                parts.append(b"transfer-encoding: chunked\r\n")
                self.chunked_response = True
            else:
                close = True  # an HTTP/1.0 client reads to end of stream
        if close:
            parts.append(b"connection: close\r\n")
        elif self.version == "1.0":
            parts.append(b"connection: keep-alive\r\n")
        parts.append(b"\r\n")
        self.close_after = close
        self.response_started = True
        client.transport.write(b"".join(parts))
        if self.is_head:
            # llhttp would wait for the body a HEAD response announces but never sends,
            # so the message ends here and the connection is not reused.
            self.finish(reuse=False)

    def _learn_app_session(self, value: bytes) -> None:
        """The worker announced an app session it holds (its MCP token names it)."""
        worker = self.worker
        session_id = value.decode("latin-1")
        if worker is not None and is_valid_id(session_id):
            self.client.state.router.sessions[session_id] = worker.owner

    def _forget_app_session(self, value: bytes) -> None:
        worker = self.worker
        sessions = self.client.state.router.sessions
        session_id = value.decode("latin-1")
        if worker is not None and sessions.get(session_id) == worker.owner:
            del sessions[session_id]

    def response_body(self, body: bytes) -> None:
        if self.chunked_response:
            self.client.transport.writelines(wire.chunk(body))
        else:
            self.client.transport.write(body)

    def response_end(self) -> None:
        if self.informational:
            self.informational = False
            return
        if self.finished:
            return
        if self.chunked_response:
            self.client.transport.write(wire.LAST_CHUNK)
        self.finish(reuse=self.upstream_keep_alive and self.request_done)

    def upstream_lost(self, exc: Exception | None) -> None:
        """The worker connection closed under this exchange."""
        self.upstream = None
        if self.finished:
            return
        if self.response_started and self.until_eof:
            self.response_end()  # the body was delimited by end of stream
            return
        self.upstream_failed(exc or ConnectionResetError("worker closed the connection"))

    def upstream_failed(self, exc: BaseException, protocol_error: bool = False) -> None:
        """Connecting, writing or parsing failed: map it to the client's answer."""
        if self.finished:
            return
        worker = self.worker
        state = self.client.state
        if protocol_error:
            self.fail("upstream_protocol_error", f"worker sent an invalid response: {exc}")
        elif (
            worker is not None
            and worker is not state.control
            and (state.router.workers.get(worker.owner) is not worker)
        ):
            self.fail("session_owner_gone", f"the worker {worker.owner} is gone")
        else:
            self.fail("upstream_connection_lost", f"worker connection failed: {exc}")

    def upstream_idle_since(self) -> float | None:
        """Coarse time of the last sign of life from the worker side; None when the
        upstream timeout does not apply (not routed yet, or a control call: those are
        bounded by their own deadline_ts, and a prepare may rightly wait minutes)."""
        if self.worker is self.client.state.control:
            return None
        if self.upstream is not None:
            return self.upstream.last_active
        return self.routed_at if self.worker is not None else None

    def timed_out(self) -> None:
        """No byte from the worker for the upstream timeout."""
        self.fail("upstream_timeout", "the worker did not answer in time")

    # ---- endings ------------------------------------------------------------------
    def fail(self, code: str, detail: str) -> None:
        """The one place failures become responses."""
        if self.finished:
            return
        if self.response_started:
            self.finish(reuse=False)
            self.client.abort()  # a truncated response must look truncated
            return
        if self.request_done or self.expect_continue:
            self._write_error(code, detail)
        else:
            # Answer once the request body has been read (and dropped), so the
            # connection stays usable; drop the worker connection now.
            self.pending_error = (code, detail)
            self._detach(reuse=False)
            self.client.resume_reading_for_upstream()

    def _write_error(self, code: str, detail: str) -> None:
        client = self.client
        close = not self.keep_alive or not self.request_done or client.state.draining
        self.close_after = close
        self.response_started = True
        self.status = status_of(code)
        client.transport.write(
            wire.error_response(code, detail, close=close, head_only=self.is_head)
        )
        self.finish(reuse=False)

    def _detach(self, reuse: bool) -> None:
        worker = self.worker
        if worker is not None:
            self.worker = None
            worker.in_flight -= 1
        conn = self.upstream
        if conn is not None:
            self.upstream = None
            if reuse and worker is not None:
                worker.pool.release(conn)
            else:
                conn.exchange = None
                conn.close()

    def finish(self, reuse: bool) -> None:
        """The response is fully written: free the worker side, let the next one go."""
        if self.finished:
            return
        self.finished = True
        self._detach(reuse)
        if self.client.state.access_log is not None:
            self._log_access(self.client.state.access_log)
        self.client.exchange_done(self)

    def abort(self) -> None:
        """The client went away: drop the worker connection (the app sees it go)."""
        if not self.finished:
            self.finished = True
            self._detach(reuse=False)
            if self.client.state.access_log is not None:
                self.status = self.status or 499  # nginx's "client closed request"
                self._log_access(self.client.state.access_log)

    def _log_access(self, logger: logging.Logger) -> None:
        elapsed = (time.perf_counter() - self.started) * 1000 if self.started else 0.0
        logger.info(
            '%s "%s %s HTTP/%s" %d %.1fms',
            self.client.peer,
            self.method.decode("latin-1"),
            self.url.decode("latin-1"),
            self.version,
            self.status,
            elapsed,
        )
