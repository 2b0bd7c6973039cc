"""Entry point of a worker process (`python -m gym_proxy.worker ...`), started by the supervisor.

Order: build the app, start it on the private Unix socket (an ASGI app's lifespan
startup runs first), then register with the coordinator, so the proxy never routes to a
worker that is not yet accepting. A worker on another node (`--socket=fd:N`, a TCP
socket its host bound) serves through its gate (`worker.link_gate`) instead, its
coordinator channel is one the proxy dials there (`--coordinator=accept`), and a stop
the proxy asks over that link is its SIGTERM (with no Ray call on the way). The worker
stops by itself when the coordinator connection ends (no orphans) and drains gracefully
on SIGTERM (an ASGI app's lifespan shutdown runs last). Failing to build or start the
app exits with BOOT_ERROR, which tells the supervisor not to respawn it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, Protocol

import uvloop
from aiohttp import web

from gym_proxy.coordinator.contract import telemetry
from gym_proxy.coordinator.contract.channel import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    RemoteError,
)
from gym_proxy.coordinator.contract.collector import freeze_startup_heap
from gym_proxy.coordinator.contract.exit_codes import BOOT_ERROR, LOST_COORDINATOR, exit_process
from gym_proxy.coordinator.contract.framing import STREAM_LIMIT
from gym_proxy.coordinator.contract.keepalive import WORKER_KEEPALIVE
from gym_proxy.coordinator.contract.messages import (
    Done,
    Message,
    ProxyStopping,
    Register,
)
from gym_proxy.coordinator.contract.worker_link import LINK_KEY_ENV
from gym_proxy.worker.aiohttp_door import RUNTIME, install_door, participation_of
from gym_proxy.worker.app_loading import build_app
from gym_proxy.worker.app_sessions import app_session_cookie
from gym_proxy.worker.asgi_door import AsgiDoor, answer_runtime_errors
from gym_proxy.worker.asgi_server import AsgiWorkerServer
from gym_proxy.worker.channel_requests import apply_tables, handle_coordinator_message
from gym_proxy.worker.declaration import Participation, declared
from gym_proxy.worker.head_limits import HeadLimits, head_limits
from gym_proxy.worker.identity import WORKER_BACKLOG, WORKER_INFO, WorkerInfo
from gym_proxy.worker.link_gate import LinkGate
from gym_proxy.worker.nemo_gym_server import NemoGymConfigError
from gym_proxy.worker.options import parse_worker_args
from gym_proxy.worker.runtime import ParticipantRuntime

__all__ = ["main", "INHERITED", "ACCEPT"]

INHERITED = "fd:"  # --socket=fd:N: listen on this inherited TCP socket, through a gate
ACCEPT = "accept"  # --coordinator=accept: the proxy dials the channel in through the gate

REGISTER_WAIT = 30.0
REJOIN_EVERY = 0.1  # seconds between a lost worker's looks for a new gym-proxy

log = logging.getLogger("gym_proxy.worker")


class WorkerServer(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def http_protocol(self) -> asyncio.Protocol: ...


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

    async def start(self) -> None:
        await self.runner.setup()
        if self.socket_path is not None:
            await web.UnixSite(self.runner, self.socket_path, backlog=WORKER_BACKLOG).start()

    def http_protocol(self) -> asyncio.Protocol:
        server = self.runner.server
        assert server is not None  # set up by start()
        return server()

    async def stop(self) -> None:
        await self.runner.cleanup()


def _host(
    app: Any, info: WorkerInfo, args: argparse.Namespace, socket_path: str | None
) -> tuple[ParticipantRuntime, WorkerServer]:
    """The runtime and the server for `app`, aiohttp or ASGI, on `socket_path` (None:
    on a gate's connections)."""
    if isinstance(app, web.Application):
        participation = participation_of(app).with_kind(args.kind)
        runtime = ParticipantRuntime(info, participation, access_log=args.access_log)
        app[WORKER_INFO] = info
        app[RUNTIME] = runtime
        install_door(app)
        limits = head_limits(args.limit_request_line, args.limit_request_headers)
        return runtime, AiohttpWorkerServer(app, socket_path, args.graceful_timeout, limits)
    participation = declared(app) or Participation(restart_only=True)
    runtime = ParticipantRuntime(
        info,
        participation.with_kind(args.kind),
        app_keyed=app_session_cookie(app) is not None,
        access_log=args.access_log,
    )
    answer_runtime_errors(app)
    server = AsgiWorkerServer(
        AsgiDoor(app, runtime), socket_path, args.graceful_timeout, args.log_level
    )
    return runtime, server


async def serve(args: argparse.Namespace, stop: asyncio.Event | None = None) -> int:
    """Run the app until `stop` is set (without one, until SIGTERM) or the coordinator
    goes away; return the exit code. Tests run workers as tasks with their own `stop`
    (`tests/in_process.py`): one process, one SIGTERM, many workers."""
    gate_socket = _inherited_socket(args.socket)
    address = args.socket if gate_socket is None else _tcp_address(gate_socket)
    info = WorkerInfo(args.slot, args.owner, os.getpid(), address)
    own_process = stop is None  # the process is this worker's: SIGTERM stops it
    if stop is None:
        stop = asyncio.Event()
    gate: LinkGate | None = None
    try:
        app = await build_app(args.app, args.app_dir, args.workers, args.session_state)
        runtime, server = _host(app, info, args, None if gate_socket else args.socket)
        await server.start()
        if gate_socket is not None:
            gate = LinkGate(gate_socket, _link_key(), server.http_protocol, stop.set)
            await gate.start()
    except NemoGymConfigError as exc:  # a mistake in the flags or config: no traceback
        print(f"gym-proxy worker {args.slot}: cannot start app {args.app}: {exc}", file=sys.stderr)
        return BOOT_ERROR
    except Exception:
        traceback.print_exc()
        print(f"gym-proxy worker {args.slot}: cannot start app {args.app}", file=sys.stderr)
        return BOOT_ERROR

    if own_process:
        freeze_startup_heap()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        # Ctrl-C reaches the whole process group; the proxy decides and sends SIGTERM.
        loop.add_signal_handler(signal.SIGINT, lambda: None)

    proxy_stopping = asyncio.Event()

    async def handle(message: Message) -> Message:
        if isinstance(message, ProxyStopping):
            proxy_stopping.set()
            return Done()
        return await handle_coordinator_message(runtime, message)

    def registration(rejoining: bool) -> Register:
        return Register(
            slot=info.slot,
            owner=info.owner,
            pid=info.pid,
            socket=info.socket_path,
            kind=runtime.kind,
            framework="aiohttp" if isinstance(app, web.Application) else "asgi",
            app_cookie=app_session_cookie(app),
            restart_only=runtime.participation.restart_only,
            rejoining=rejoining,
            held=runtime.store.last_used() if rejoining else {},
            marks=runtime.marks.as_dict() if rejoining else {},
            expected=runtime.claims.attempts() if rejoining else {},
        )

    try:
        channel, channel_task = await _register(
            args.coordinator, handle, runtime, registration(False), gate
        )
    except (OSError, TimeoutError, ChannelClosed, ChannelTimeout, RemoteError) as exc:
        why = exc or "the proxy did not dial in"
        log.error("worker %d could not register with the coordinator: %s", info.slot, why)
        if gate is not None:
            gate.close()
        await server.stop()
        return LOST_COORDINATOR
    log.debug("worker %d registered as %s", info.slot, info.owner)

    runtime.loop_lag.start()
    telemetry.start(
        args.instance,
        f"{args.instance}-w{info.slot}-{info.owner}",
        **{"gym_proxy.slot": str(info.slot)},
    )
    expiry = None
    runtime.moved_away.idle_ttl = args.session_idle_ttl
    if args.session_idle_ttl > 0:
        expiry = asyncio.create_task(runtime.expire_sessions(args.session_idle_ttl))
    stop_task = asyncio.create_task(stop.wait())
    code = 0
    try:
        while True:
            await asyncio.wait({channel_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set() or proxy_stopping.is_set():
                break  # a gym-proxy that stops for good leaves no worker waiting for it
            channel.close()
            if gate is not None:  # on another node: it is nobody's to adopt (docs/ray.md)
                log.warning("worker %d lost the coordinator; stopping", info.slot)
                code = 0 if stop.is_set() else LOST_COORDINATOR
                break
            joined = await _rejoin(args, info.slot, stop, handle, runtime, registration)
            if joined is None:
                code = 0 if stop.is_set() else LOST_COORDINATOR
                break
            channel, channel_task = joined
    except asyncio.CancelledError:
        # A worker run as a task, killed: its channel goes first, as a killed process's
        # would, so the proxy stops routing to it at once.
        channel.close()
        raise
    finally:
        stop_task.cancel()
        runtime.loop_lag.stop()
        if expiry is not None:
            expiry.cancel()
        if gate is not None:
            gate.close()
        await server.stop()
        channel.close()
        channel_task.cancel()
        telemetry.shutdown()
    return code


async def _register(
    path: str,
    handle: Callable[[Message], Awaitable[Message]],
    runtime: ParticipantRuntime,
    registration: Register,
    gate: LinkGate | None = None,
) -> tuple[Channel, asyncio.Task[None]]:
    """Connect to the coordinator at `path` (with a gate: take the channel the proxy
    dials in), register, and take the reply's tables; raises OSError, TimeoutError,
    ChannelClosed, ChannelTimeout or RemoteError (refused)."""
    if gate is not None:
        reader, writer = await gate.next_channel(REGISTER_WAIT)
    else:
        reader, writer = await asyncio.open_unix_connection(path, limit=STREAM_LIMIT)
    channel = Channel(reader, writer, handle)
    channel.pong_lag = lambda: runtime.loop_lag.take_worst("ping")
    channel_task = asyncio.create_task(channel.serve())
    try:
        reply = await channel.request(registration, within=REGISTER_WAIT)
    except BaseException:
        channel.close()
        channel_task.cancel()
        raise
    runtime.channel = channel
    if registration.rejoining:
        # The claims this worker still lists stay: the new coordinator reads their records
        # again from the checkpoint (coordinator/claims_recovery.py), or refuses the
        # replacement (409 stale_attempt), never running it from its start in silence.
        runtime.marks.merge(reply.tables.marks)
    else:
        apply_tables(runtime, reply.tables)
    if reply.checkpoint_id is not None:
        runtime.close_gate(reply.checkpoint_id)
    elif registration.rejoining and not runtime.is_open:
        # The checkpoint that closed the gate died with the old proxy: the new one
        # reports itself idle, and a controller that goes on is refused and starts again.
        runtime.open_gate()
    return channel, channel_task


async def _rejoin(
    args: argparse.Namespace,
    slot: int,
    stop: asyncio.Event,
    handle: Callable[[Message], Awaitable[Message]],
    runtime: ParticipantRuntime,
    registration: Callable[[bool], Register],
) -> tuple[Channel, asyncio.Task[None]] | None:
    """The coordinator is gone. With `--orphan-grace`, keep the sessions and the requests
    running, and register with a gym-proxy started again on the same coordinator socket
    within the grace; None when none did (or it refused, or SIGTERM came): stop."""
    grace = args.orphan_grace
    if grace <= 0:
        log.warning("worker %d lost the coordinator; stopping", slot)
        return None
    log.warning(
        "worker %d lost the coordinator; keeping its %d sessions up to %g s for a gym-proxy "
        "started again with the same --runtime-dir to adopt it",
        slot,
        len(runtime.store),
        grace,
    )
    deadline = time.monotonic() + grace
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            joined = await _register(args.coordinator, handle, runtime, registration(True))
        except RemoteError as exc:
            log.error("worker %d: the new gym-proxy refused to adopt it: %s", slot, exc)
            return None
        except (OSError, ChannelClosed, ChannelTimeout):
            # Nobody listens yet (or the socket is the dead proxy's): look again shortly.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), REJOIN_EVERY)
            continue
        log.warning("worker %d adopted by the new gym-proxy", slot)
        return joined
    if not stop.is_set():
        log.warning("worker %d: no gym-proxy adopted it within %g s; stopping", slot, grace)
    return None


def _inherited_socket(option: str) -> socket.socket | None:
    """The TCP socket a remote worker's host passed down (`--socket=fd:N`), else None."""
    if not option.startswith(INHERITED):
        return None
    return socket.socket(fileno=int(option[len(INHERITED) :]))


def _tcp_address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"tcp://{host}:{port}"


def _link_key() -> bytes:
    """The link key from the environment, which keeps it no longer (the app never sees it)."""
    return bytes.fromhex(os.environ.pop(LINK_KEY_ENV))


def _joined_ray() -> bool:
    """Whether the app joined a Ray cluster it did not start: the server's, named in its
    config (NeMo Gym's `initialize_ray()`). An app that started a cluster itself leaves
    through `ray.shutdown()` and Ray's exit hook, which stop that cluster's processes."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    return node is not None and not node.is_head()


def _exit_leaving_ray(code: int) -> NoReturn:
    """Exit at once, leaving the Ray cluster by closing the connection. NeMo Gym's
    launcher gives a server one second to stop; `ray.shutdown()` took 0.3 s here, and
    Ray's exit hook sleeps another 0.5 s first (for log lines), after the app had
    stopped. The raylet sees a driver's connection close and ends its job, its tasks and
    its leased workers, as after a crash; the app's requests have all finished by now."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_worker_args(argv)
    # Before anything imports websockets (uvicorn, or the app itself).
    head_limits(args.limit_request_line, args.limit_request_headers).raise_websockets_limits()
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s worker[{args.slot}:{os.getpid()}] %(levelname)s %(message)s",
    )
    if args.access_log:  # asked for: logged whatever the level
        logging.getLogger("gym_proxy.worker.access").setLevel(logging.INFO)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(serve(args))
    if _joined_ray():
        _exit_leaving_ray(code)
    exit_process(code)
