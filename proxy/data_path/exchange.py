"""One request/response pair crossing the proxy: an explicit state machine.

The client connection feeds request events in, the worker connection feeds response
events in, and the exchange writes through two sinks it is given, the client's outbox
and the worker connection's outbox (`proxy.data_path.outbox`), so tests can drive it in
process. Heads are rewritten by pure functions (`proxy.data_path.request_head`,
`proxy.data_path.response_head`).

States (one at a time; the request side's progress is `request_done`, orthogonal):

    QUEUED      head parsed, behind another request of the pipeline     writes nothing
    HELD        routed to a session that is moving, or to a worker      writes nothing
                leaving service: it waits unrouted (`Router.holding`,
                `WorkerRoute.held`) until that ends, then is routed
                anew; reading pauses once a body chunk is kept
    CONNECTING  routed; waiting for a worker connection (body buffered; may write 100-continue
                reading pauses once a chunk is kept)
    SENDING     head sent to the worker; request body streams to it     body -> worker
    RESPONDING  response head sent; response body streams to the client body -> client
                (the request body may still stream to the worker: full duplex)
    TUNNEL      after a 101: bytes pass both ways untouched             bytes -> both
    HANDOVER    the worker gave the request back (its episode was       nothing
                handed over, `worker.handovers`): its answer, the
                request's body, is read, then the request is sent on
                to the target, unchanged
    ANSWERING   the proxy's own answer is decided; the rest of the      nothing, then the
                request body is read and dropped first                  answer -> client
    DONE        answered (or cut); nothing more is written

Transitions (`TRANSITIONS` below, consulted on every change: `proxy.state_tables`; a test
checks this drawing against it):

    QUEUED     --start: routed--------------------------------> CONNECTING
    QUEUED     --start: its session moves, or its worker leaves-> HELD
    HELD       --the move or the hold ended: routed anew-------> CONNECTING | HELD
    CONNECTING --attach(worker connection)---------------------> SENDING
    SENDING    --response head, 1xx but 101 dropped-------------> RESPONDING | TUNNEL
    SENDING    --the hand-over marker the mover expects--------> HANDOVER
    HANDOVER   --its end: sent on to the target----------------> CONNECTING
    RESPONDING --response end----------------------------------> DONE
    TUNNEL     --either side closes----------------------------> DONE
    ANSWERING  --request end: the answer written---------------> DONE
    QUEUED | HELD | CONNECTING | SENDING | HANDOVER --fail, body still coming--> ANSWERING
    QUEUED | HELD | CONNECTING | SENDING | HANDOVER --fail, request read: answered--> DONE
    RESPONDING | TUNNEL --fail after a response byte: the client connection cut--> DONE
    QUEUED | HELD | CONNECTING | SENDING | HANDOVER | ANSWERING --the client went away--> DONE

Every failure becomes a response in one method, `fail`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Final

from gym_proxy.coordinator.contract.errors import GymError, WorkerGone, status_of
from gym_proxy.coordinator.contract.headers import (
    CONTROL_PREFIX,
    EMPTY_ROLLOUT_KEY,
    HANDOVER_HEADER,
    HANDOVER_STATUS,
    ROLLOUT_PREFIX,
    split_rollout_url,
)
from gym_proxy.coordinator.contract.ids import is_valid_id
from gym_proxy.proxy.data_path import http_wire as wire
from gym_proxy.proxy.data_path.outbox import batch as write_batch
from gym_proxy.proxy.data_path.outbox import hold, release
from gym_proxy.proxy.data_path.request_head import RequestHead, rewrite_request_head
from gym_proxy.proxy.data_path.response_head import rewrite_response_head
from gym_proxy.proxy.data_path.routing import (
    APP_COOKIE,
    APP_TOKEN,
    WORKER_WATCH,
    ExpectedHandover,
    Router,
    WorkerRoute,
)
from gym_proxy.proxy.data_path.session_tokens import TokenError
from gym_proxy.proxy.state_tables import masks, wrong_transition

if TYPE_CHECKING:
    import asyncio

    from gym_proxy.proxy.data_path.client_connection import ClientConnection
    from gym_proxy.proxy.data_path.upstream import UpstreamConnection, UpstreamPool

__all__ = [
    "Exchange",
    "QUEUED",
    "CONNECTING",
    "SENDING",
    "RESPONDING",
    "TUNNEL",
    "ANSWERING",
    "DONE",
    "HANDOVER",
    "HELD",
    "STATE_NAMES",
    "TRANSITIONS",
    "start_held",
    "start_held_by_worker",
]

# Final ints, as the client connection's phases: the compiled data path (setup.py)
# inlines them instead of looking them up. STATE_NAMES names them for a human.
QUEUED: Final = 0
CONNECTING: Final = 1
SENDING: Final = 2
RESPONDING: Final = 3
TUNNEL: Final = 4
ANSWERING: Final = 5
DONE: Final = 6
HANDOVER: Final = 7
HELD: Final = 8
STATE_NAMES: Final = (
    "queued",
    "connecting",
    "sending",
    "responding",
    "tunnel",
    "answering",
    "done",
    "handover",
    "held",
)
_BEFORE_A_RESPONSE: Final = (ANSWERING, DONE)  # where a failure goes before any response byte
TRANSITIONS: Final[dict[int, tuple[int, ...]]] = {
    QUEUED: (CONNECTING, HELD) + _BEFORE_A_RESPONSE,
    HELD: (CONNECTING, HELD) + _BEFORE_A_RESPONSE,
    CONNECTING: (SENDING,) + _BEFORE_A_RESPONSE,
    SENDING: (RESPONDING, TUNNEL, HANDOVER) + _BEFORE_A_RESPONSE,
    HANDOVER: (CONNECTING,) + _BEFORE_A_RESPONSE,
    RESPONDING: (DONE,),
    TUNNEL: (DONE,),
    ANSWERING: (DONE,),
    DONE: (),
}
_NEXT: Final = masks(TRANSITIONS, len(STATE_NAMES))
# Bound here as Finals of this compiled module: read per request, never looked up in
# the (uncompiled) contract module.
_CONTROL_PREFIX: Final = CONTROL_PREFIX
_ROLLOUT_PREFIX: Final = ROLLOUT_PREFIX
_HANDOVER_HEADER: Final = HANDOVER_HEADER
_HANDOVER_STATUS: Final = HANDOVER_STATUS
_WORKER_WATCH: Final = WORKER_WATCH
# A request this large may not leave in one write; its connection keeps a spare descriptor.
SPARE_AFTER_BYTES: Final = 65536


class Exchange:
    """One request from its head to the end of its response (see the module docstring)."""

    __slots__ = (
        "client",
        "state",
        "method",
        "url",
        "headers",
        "version",
        "keep_alive",
        "upgrade",
        "request_done",
        "chunked_request",
        "expect_continue",
        "body_buffer",
        "worker",
        "upstream",
        "head",
        "new_token",
        "cookie_token",
        "cookie_name",
        "error",
        "chunked_response",
        "until_eof",
        "upstream_keep_alive",
        "close_after",
        "status",
        "started",
        "routed_at",
        "sent_batch",
        "sent_bytes",
        "slot",
        "session_id",
        "held_since",
        "span",
        "handover",
    )

    def __init__(self, client: ClientConnection) -> None:
        self.client = client
        self.state = QUEUED
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.method = b"GET"
        self.version = "1.1"
        self.keep_alive = True
        self.upgrade = False  # the client asked to switch protocols (WebSocket)
        self.request_done = False
        self.chunked_request = False
        self.expect_continue = False
        self.body_buffer: list[bytes] | None = None
        self.worker: WorkerRoute | None = None
        self.upstream: UpstreamConnection | None = None
        self.head = b""
        self.new_token: bytes | None = None
        self.cookie_token: bytes | None = None  # routed by this cookie of ours ...
        self.cookie_name = b""  # ... of this name
        self.error: tuple[str, str] | None = None  # the answer, decided before start
        self.chunked_response = False
        self.until_eof = False
        self.upstream_keep_alive = False
        self.close_after = False
        self.status = 0
        self.started = 0.0
        self.routed_at = 0.0  # coarse time the request was sent toward a worker
        self.sent_batch = 0  # the outbox batch of the first write to the worker
        self.sent_bytes = 0
        self.slot = -2  # the worker slot routed to (-1: the control app), for the access log
        self.held_since = 0.0  # monotonic time it began to wait for a move (0: never held)
        self.span: object = None  # its span, with --trace-requests (proxy.metrics.request_spans)
        self.session_id: str | None = None  # the session it was routed under, once routed
        self.handover: ExpectedHandover | None = None  # in HANDOVER: where it goes on to

    @property
    def finished(self) -> bool:
        return self.state == DONE

    def _to(self, new: int) -> None:
        """The one way the state changes: by the table (module docstring)."""
        old = self.state
        if not (_NEXT[old] >> new) & 1:
            wrong_transition("exchange", STATE_NAMES, old, new)
        self.state = new

    # ---- QUEUED -> CONNECTING ----------------------------------------------------
    def start(self) -> None:
        """Route the request and send it on; called when it heads the pipeline."""
        if self.client.proxy_state.access_log is not None:
            self.started = time.perf_counter()
        spans = self.client.proxy_state.request_spans
        if spans is not None and self.span is None:
            self.span = spans.begin(self.method, self.url, self.headers)
        if self.error is not None:
            self.fail(*self.error)
            return
        try:
            proxy = self.client.proxy_state
            head = rewrite_request_head(
                self.method, self.url, self.version, self.headers, self.upgrade, proxy.token_prefix
            )
        except GymError as exc:
            self.keep_alive = False  # the bytes are not a request we forward
            self.fail(exc.code, exc.detail)
            return
        except TokenError as damaged:  # (mypyc types each `as` name once per function)
            self.fail("invalid_session_token", str(damaged))
            return
        self.chunked_request = head.chunked
        self.expect_continue = head.expect_continue
        if self.url.startswith(_CONTROL_PREFIX):
            worker = self.client.proxy_state.control
        else:
            routed = self._route_session(head)
            if routed is None:
                return  # answered with an error
            worker = routed
        out = head.out
        if head.chunked:
            out.write(b"transfer-encoding: chunked\r\n\r\n")
        elif head.content_length is not None:
            out.write(b"content-length: ")
            out.write(head.content_length)
            out.write(b"\r\n\r\n")
        else:
            out.write(b"\r\n")
        self.head = out.getvalue()
        self._routed_to(worker)
        if self.expect_continue and not self.request_done:
            self.client.outbox.write(wire.CONTINUE_100)
        pool: UpstreamPool = worker.pool  # typed (WorkerRoute's is Any): a native call
        pool.acquire(self)

    def _routed_to(self, worker: WorkerRoute) -> None:
        """-> CONNECTING, counted on `worker` (its pool is asked next)."""
        worker.in_flight += 1
        worker.served += 1
        self.worker = worker
        self.slot = worker.slot
        self.routed_at = self.client.proxy_state.now
        self._to(CONNECTING)

    def _held(self) -> None:
        """-> HELD: it waits, unrouted, to be started again (`start_held`)."""
        self.held_since = self.held_since or time.monotonic()
        self._to(HELD)

    def _route_session(self, head: RequestHead) -> WorkerRoute | None:
        """Pick the worker and add the identity headers; None after answering an error."""
        proxy = self.client.proxy_state
        if proxy.booting:
            self.fail("worker_unavailable", "gym-proxy is starting: not every worker registered")
            return None
        key: bytes | None = None
        rest = b""
        if self.url.startswith(_ROLLOUT_PREFIX):
            key, rest = split_rollout_url(self.url)
            if not key:
                self.fail(*EMPTY_ROLLOUT_KEY)
                return None
        try:
            route = proxy.router.route_request(
                proxy.codec,
                proxy.cookie_name,
                head.token,
                head.cookie,
                head.owner_hint,
                head.app_token,
            )
        except TokenError as damaged:  # (mypyc types each `as` name once per function)
            self.fail("invalid_session_token", str(damaged))
            return None
        except GymError as exc:
            self.fail(exc.code, exc.detail)
            return None
        router = proxy.router
        session_id = route.session_id
        if router.holding and session_id in router.holding:
            # Its session is moving: it waits here, unrouted, and starts again after.
            router.holding[session_id].append(self)
            self._held()
            return None
        worker = route.worker
        if worker.held is not None:
            # Its worker is being taken out of service: it waits, and is routed anew after.
            worker.held.append(self)
            self._held()
            return None
        self.session_id = session_id
        router.active[session_id] = router.active.get(session_id, 0) + 1
        router.decisions[route.rule] += 1
        if key is not None and not worker.keeps_rollout_prefix:
            # aiohttp routes before any middleware: the app sees /rest, the runtime the key.
            head.set_target(self.method, rest)
            head.add_line(wire.EPISODE_KEY_LINE, key)
        if route.rule == APP_TOKEN or route.rule == APP_COOKIE:
            # Only the worker was picked by what the client wrote: the app verifies its own
            # token or cookie, and the request has no gym-proxy session (proxy.data_path.routing).
            head.add_line(wire.APP_SESSION_CLAIM_LINE, route.session_id.encode())
            return worker
        token = route.token
        if route.new:
            if head.app_token is not None:
                # The proxy mints nothing for a call that carries an app's own token: one
                # naming no session it routes by reaches the app with no session at all.
                return worker
            token = proxy.codec.sign(route.session_id, worker.owner).encode()
            self.new_token = token
            head.out.write(wire.SESSION_NEW_LINE)
        elif route.cookie is not None:
            self.cookie_token = token
            self.cookie_name = route.cookie
        head.add_line(wire.SESSION_ID_LINE, route.session_id.encode())
        if token is not None:
            head.add_line(wire.SESSION_TOKEN_LINE, token)
        return worker

    # ---- request body ------------------------------------------------------------
    def request_body(self, body: bytes | memoryview) -> None:
        """Body bytes from the client: bytes, or a view of the read buffer, which only a
        write may keep (read_buffer); kept here, it is copied."""
        state = self.state
        if state == SENDING or state == RESPONDING or state == TUNNEL:
            conn = self.upstream
            if conn is None:
                return
            conn.last_active = self.client.proxy_state.now
            if state == TUNNEL:
                conn.outbox.write(body)
                return
            self.sent_bytes += len(body)
            if self.sent_batch != write_batch() or self.sent_bytes > SPARE_AFTER_BYTES:
                conn.keep_spare()  # a write after the first: it may meet a closed worker
            if self.chunked_request:
                conn.outbox.writelines(wire.chunk(body))
            else:
                conn.outbox.write(body)
        elif state == CONNECTING or state == QUEUED or state == HELD:
            # Not sent yet (no worker connection, or held while its session moves): keep
            # what came and let the client wait, so the proxy's memory does not grow with
            # the body; reading resumes once it goes out (attach) or is answered (fail).
            if self.body_buffer is None:
                self.body_buffer = []
            self.body_buffer.append(bytes(body))
            self.client.pause_reading_for_upstream()
        # ANSWERING, DONE: the answer is decided; the body is read and dropped

    def request_end(self) -> None:
        self.request_done = True
        state = self.state
        if state == ANSWERING:
            self._write_error(*self.error)  # type: ignore[misc]
        elif (state == SENDING or state == RESPONDING) and self.chunked_request:
            self.upstream.outbox.write(wire.LAST_CHUNK)  # type: ignore[union-attr]

    # ---- CONNECTING -> SENDING ---------------------------------------------------
    def attach(self, conn: UpstreamConnection) -> None:
        """Send the request on `conn`, with whatever body arrived while connecting."""
        self.upstream = conn
        self._to(SENDING)
        conn.exchange = self
        conn.last_active = self.client.proxy_state.now
        outbox = conn.outbox
        outbox.write(self.head)
        sent = len(self.head)
        self.sent_batch = write_batch()
        if self.body_buffer:
            for body in self.body_buffer:
                sent += len(body)
                if self.chunked_request:
                    outbox.writelines(wire.chunk(body))
                else:
                    outbox.write(body)
            self.body_buffer = None
        if self.request_done and self.chunked_request:
            outbox.write(wire.LAST_CHUNK)
        self.sent_bytes = sent
        if sent > SPARE_AFTER_BYTES:
            conn.keep_spare()  # a write this large may not go out at once
        client = self.client
        if client.write_paused:
            conn.pause_reading()
        if client.read_pause and not conn.write_paused:
            client.resume_reading_for_upstream()

    # ---- SENDING -> RESPONDING | TUNNEL ------------------------------------------
    def response_head(
        self, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool
    ) -> None:
        if self.state == DONE:
            return
        if status < 200 and status != 101:
            return  # 1xx: the proxy answered Expect itself; an interim answer is dropped
        self.upstream_keep_alive = keep_alive
        worker = self.worker
        if status == _HANDOVER_STATUS and self.client.proxy_state.router.handovers:
            handover = self._expected_handover(headers)
            if handover is not None:
                self.handover = handover
                self.body_buffer = []
                self._to(HANDOVER)
                return
        self.status = status
        if worker is not None:
            worker.responses[status // 100 if status < 600 else 5] += 1
        client = self.client
        if self.new_token is not None:
            extra = wire.set_cookie_headers(client.proxy_state.cookie_name, self.new_token)
        elif self.cookie_token is not None:
            # Re-set on every answer, as Starlette does its session cookie: NeMo Gym's
            # clients send on only the cookies of the last response they got.
            extra = wire.refresh_cookie_header(self.cookie_name, self.cookie_token)
        else:
            extra = b""
        # A response that starts before the request body ended may end first; the rest of
        # the body is then dropped, and the connection cannot be reused.
        head = rewrite_response_head(
            status,
            headers,
            http10=self.version == "1.0",
            head_request=self.method == b"HEAD",
            close=not self.keep_alive or not self.request_done or client.proxy_state.draining,
            extra=extra,
        )
        if head.app_session is not None or head.app_session_end is not None:
            self._app_sessions(head.app_session, head.app_session_end)
        if head.tunnel and not self.upgrade:  # a 101 nobody asked for cannot be relayed
            self.upstream_failed(ValueError("a 101 to a request without Upgrade"), True)
            return
        self.chunked_response = head.chunked
        self.until_eof = head.until_eof
        self.close_after = head.close
        client.outbox.write(head.data)
        if head.tunnel:
            self._to(TUNNEL)
            self.close_after = True
            client.start_tunnel(self)
            return
        self._to(RESPONDING)

    def _app_sessions(self, started: bytes | None, ended: bytes | None) -> None:
        """The worker announced an app session it holds (its MCP token names it), or its
        end; the session table follows."""
        worker = self.worker
        if worker is None:
            return
        sessions = self.client.proxy_state.router.app_sessions
        if started is not None:
            session_id = started.decode("latin-1")
            if is_valid_id(session_id):
                sessions[session_id] = worker.owner
        if ended is not None:
            session_id = ended.decode("latin-1")
            if sessions.get(session_id) == worker.owner:
                del sessions[session_id]

    def _expected_handover(self, headers: list[tuple[bytes, bytes]]) -> ExpectedHandover | None:
        """The hand-over the marker in `headers` names, if the mover expects it from this
        worker (any other answer, a forged marker included, is relayed as it is)."""
        handovers = self.client.proxy_state.router.handovers
        for name, value in headers:
            if name.lower() == _HANDOVER_HEADER:
                handover = handovers.get(value)
                if handover is not None and handover.source is self.worker:
                    del handovers[value]
                    return handover
        return None

    def _send_on(self, reusable: bool) -> None:
        """HANDOVER -> CONNECTING: the request, its body as the worker gave it back, goes
        to the hand-over's target; the client sees only the target's answer."""
        handover = self.handover
        assert handover is not None
        body = b"".join(self.body_buffer or ())
        self.body_buffer = None
        source = self.worker
        conn = self.upstream
        self.upstream = None
        if conn is not None:
            if reusable and self.upstream_keep_alive and source is not None:
                source_pool: UpstreamPool = source.pool
                source_pool.release(conn)
            else:
                conn.exchange = None
                conn.close()
        if source is not None:
            source.in_flight -= 1
        self.worker = None
        target = handover.target
        if not self.request_done:
            why = "the worker gave the request back before its body had all come"
            handover.settle(why)
            self.fail("upstream_protocol_error", why)
            return
        if self.client.proxy_state.router.workers.get(target.owner) is not target:
            handover.settle("the target worker is gone")
            self.fail("session_owner_gone", f"the worker {target.owner} is gone")
            return
        self.handover = None
        self.body_buffer = [body] if body else None
        self._routed_to(target)
        handover.settle("")
        target_pool: UpstreamPool = target.pool
        target_pool.acquire(self)

    def response_body(self, body: bytes) -> None:
        if self.state == HANDOVER:
            self.body_buffer.append(body)  # type: ignore[union-attr]
            return
        if self.state == RESPONDING:
            if self.chunked_response:
                self.client.outbox.writelines(wire.chunk(body))
            else:
                self.client.outbox.write(body)
        elif self.state == TUNNEL:
            client = self.client
            client.last_active = client.proxy_state.now  # the tunnel idle timeout counts both ways
            client.outbox.write(body)

    def response_end(self, reusable: bool = True) -> None:
        """The worker's response ended. `reusable`: the response side ended exactly at a
        message boundary (`proxy.data_path.upstream` judges that); the connection goes back to the
        pool only if the request side did too and the worker keeps it alive."""
        if self.state == HANDOVER:
            self._send_on(reusable)
            return
        if self.state != RESPONDING:
            return
        if self.chunked_response:
            self.client.outbox.write(wire.LAST_CHUNK)
        self.finish(reuse=reusable and self.upstream_keep_alive and self.request_at_boundary)

    @property
    def request_at_boundary(self) -> bool:
        """The worker has been sent exactly one whole request and nothing after it. Not
        so for an upgrade request whatever the answer: a server may stop parsing HTTP
        after such a head (aiohttp does), so what the proxy sends next on that connection
        would not be read as a request."""
        return self.request_done and not self.upgrade

    # ---- failures ------------------------------------------------------------------
    def upstream_lost(self, exc: Exception | None) -> None:
        """The worker connection closed under this exchange."""
        self.upstream = None
        state = self.state
        if state == DONE:
            return
        if state == TUNNEL:
            self.finish(reuse=False)
            self.client.close()  # the worker ended the tunnel: so does the client side
            return
        if state == RESPONDING and self.until_eof:
            self.response_end()  # the body was delimited by the end of the stream
            return
        self.upstream_failed(exc or ConnectionResetError("worker closed the connection"))

    def upstream_failed(self, exc: BaseException, protocol_error: bool = False) -> None:
        """Connecting, writing or parsing failed: map it to the client's answer."""
        if self.state == DONE:
            return
        worker = self.worker
        proxy = self.client.proxy_state
        if protocol_error:
            self.fail("upstream_protocol_error", f"worker sent an invalid response: {exc}")
        elif (
            worker is not None
            and worker is not proxy.control
            and (
                isinstance(exc, WorkerGone) or proxy.router.workers.get(worker.owner) is not worker
            )
        ):
            self.fail("session_owner_gone", f"the worker {worker.owner} is gone")
        else:
            self.fail("upstream_connection_lost", f"worker connection failed: {exc}")

    def upstream_idle_since(self) -> float | None:
        """Coarse time of the last sign of life from the worker side; None when the
        upstream timeout does not apply (not routed yet, a tunnel: it has its own idle
        timeout, or a control call: bounded by its own deadline_ts, and a prepare may
        rightly wait minutes)."""
        if self.worker is self.client.proxy_state.control or self.state == TUNNEL:
            return None
        if self.upstream is not None:
            return self.upstream.last_active
        return self.routed_at if self.worker is not None else None

    def timed_out(self) -> None:
        """No byte from the worker for the upstream timeout."""
        self.fail("upstream_timeout", "the worker did not answer in time")

    def fail(self, code: str, detail: str) -> None:
        """The one place failures become responses."""
        state = self.state
        if state == DONE or state == ANSWERING:
            return
        if self.handover is not None:
            self.handover.settle(f"{code}: {detail}")
        if state == RESPONDING or state == TUNNEL:
            self.client.proxy_state.responses_cut += 1
            self.finish(reuse=False)
            self.client.abort()  # a truncated response must look truncated
            return
        if self.request_done or self.expect_continue:
            self._write_error(code, detail)
        else:
            # Answer once the request body has been read (and dropped), so the
            # connection stays usable; drop the worker connection now.
            self.error = (code, detail)
            self._to(ANSWERING)
            self._detach(reuse=False)
            self.client.resume_reading_for_upstream()

    def _write_error(self, code: str, detail: str) -> None:
        client = self.client
        close = not self.keep_alive or not self.request_done or client.proxy_state.draining
        self.close_after = close
        self.status = status_of(code)
        errors = client.proxy_state.errors
        errors[code] = errors.get(code, 0) + 1
        client.outbox.write(
            wire.error_response(code, detail, close=close, head_only=self.method == b"HEAD")
        )
        self.finish(reuse=False)

    # ---- -> DONE -------------------------------------------------------------------
    def _detach(self, reuse: bool) -> None:
        session_id = self.session_id
        if session_id is not None:
            self.session_id = None
            router = self.client.proxy_state.router
            active = router.active
            count = active.get(session_id, 0)
            if count > 1:
                active[session_id] = count - 1
            elif count:
                del active[session_id]  # (pop with a default is a generic call, compiled)
            if router.watchers:  # empty but while an operation waits
                _wake(router.watchers, session_id)
        worker = self.worker
        if worker is not None:
            self.worker = None
            worker.in_flight -= 1
            watchers = self.client.proxy_state.router.watchers
            if watchers:
                _wake(watchers, _WORKER_WATCH + worker.owner)
        conn = self.upstream
        if conn is not None:
            self.upstream = None
            if reuse and worker is not None:
                pool: UpstreamPool = worker.pool
                pool.release(conn)
            else:
                conn.exchange = None
                conn.close()

    def finish(self, reuse: bool) -> None:
        """The response is written (or cut): free the worker side, let the next one go."""
        if self.state == DONE:
            return
        self._to(DONE)
        if self.handover is not None:
            self.handover.settle(f"its request ended at the proxy ({STATE_NAMES[HANDOVER]})")
            self.handover = None
        slot = self.slot
        self._detach(reuse)
        if self.client.proxy_state.access_log is not None:
            self._log_access(self.client.proxy_state.access_log)
        if self.span is not None:
            span, self.span = self.span, None
            spans = self.client.proxy_state.request_spans
            assert spans is not None  # they began the span
            spans.end(span, self.status, slot)
        self.client.exchange_done(self)

    def abort(self) -> None:
        """The client went away: drop the worker connection (the app sees it go)."""
        if self.state != DONE:
            self._to(DONE)
            if self.handover is not None:
                self.handover.settle("its client went away")
                self.handover = None
            self._detach(reuse=False)
            if self.client.proxy_state.access_log is not None:
                self.status = self.status or 499  # nginx's "client closed request"
                self._log_access(self.client.proxy_state.access_log)

    def _log_access(self, logger: logging.Logger) -> None:
        elapsed = (time.perf_counter() - self.started) * 1000 if self.started else 0.0
        slot = self.slot
        logger.info(
            '%s "%s %s HTTP/%s" %d %.1fms worker=%s',
            self.client.peer,
            self.method.decode("latin-1"),
            self.url.decode("latin-1"),
            self.version,
            self.status,
            elapsed,
            slot if slot >= 0 else ("control" if slot == -1 else "-"),
        )


def _wake(watchers: dict[str, list[asyncio.Future[None]]], key: str) -> None:
    """A request of `key` (a session, or a worker: `proxy.fleet.moves.session_watch`) ended."""
    for waiter in watchers.pop(key, ()):
        if not waiter.done():
            waiter.set_result(None)


def start_held(router: Router, session_ids: list[str]) -> list[float]:
    """A move of these sessions ended: their held requests start again, routed by the
    tables as they are now (a request whose client went away meanwhile is skipped).
    Answers how long each waited, in seconds."""
    held: list[Exchange] = []
    for session_id in session_ids:
        held += router.holding.pop(session_id, ())
    return _start_again(held)


def start_held_by_worker(worker: WorkerRoute) -> list[float]:
    """Requests held at `worker` start again, routed anew (module docstring)."""
    held, worker.held = worker.held or [], None
    return _start_again(held)


def _start_again(exchanges: list[Exchange]) -> list[float]:
    now = time.monotonic()
    waits = []
    hold()  # a burst of starts: one write per transport
    try:
        for exchange in exchanges:
            if exchange.state == HELD:  # not answered or gone meanwhile
                waits.append(now - exchange.held_since)
                exchange.held_since = 0.0
                exchange.start()
    finally:
        release()
    return waits
