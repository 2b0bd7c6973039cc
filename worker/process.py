"""A worker process (`python -m gym_proxy.worker ...`), started by the supervisor, and its
life cycle, as the proxy's `Server` has it (`proxy.server`): `WorkerServer.startup`,
`WorkerServer.serve`, then `WorkerServer.shutdown`; `WorkerServer.run` does all of it.

Start order: build the app, start it on the private Unix socket (an ASGI app's lifespan
startup runs first), or, on another node (`--socket=fd:N`, a TCP socket its host bound),
behind its gate (`worker.link_gate`); then register with the coordinator (placed, over
a channel the proxy dials in through the gate, `--coordinator=accept`), so the proxy
never routes to a worker that is not yet accepting; then the loop-lag sampler,
telemetry and the session expiry. Each resource registers its own close as it opens
(an `AsyncExitStack`), so the teardown is the start read backwards.

Stop: on SIGTERM (placed, also a stop the proxy asks over the link, with no Ray call on
the way), or when the proxy says it stops for good, the worker stops accepting and drains
gracefully (an ASGI app's lifespan shutdown runs last) while its channel is still up;
then the resources close. A worker whose coordinator channel ends stops by itself (no
orphans), unless, with `--orphan-grace`, a gym-proxy started again adopts it in time (a
placed worker is nobody's to adopt: docs/ray.md). Failing to build or start the app
exits with BOOT_ERROR, which tells the supervisor not to respawn it; failing to register,
with LOST_COORDINATOR.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
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
from gym_proxy.coordinator.contract.messages import Done, Message, Pong, ProxyStopping, Register
from gym_proxy.coordinator.contract.process_memory import resident_bytes
from gym_proxy.coordinator.contract.worker_link import LINK_KEY_ENV
from gym_proxy.worker.aiohttp_door import RUNTIME, install_door, participation_of
from gym_proxy.worker.aiohttp_server import AiohttpWorkerServer
from gym_proxy.worker.app_loading import build_app
from gym_proxy.worker.app_sessions import app_session_cookie
from gym_proxy.worker.asgi_door import AsgiDoor, answer_runtime_errors
from gym_proxy.worker.asgi_server import AsgiWorkerServer
from gym_proxy.worker.channel_requests import apply_tables, handle_coordinator_message
from gym_proxy.worker.declaration import Participation, declared
from gym_proxy.worker.head_limits import head_limits
from gym_proxy.worker.identity import WORKER_INFO, WorkerInfo
from gym_proxy.worker.link_gate import LinkGate, address_of
from gym_proxy.worker.nemo_gym_server import NemoGymConfigError
from gym_proxy.worker.options import WorkerArgs, parse_worker_args
from gym_proxy.worker.runtime import ParticipantRuntime

__all__ = ["WorkerServer", "serve", "main", "INHERITED", "ACCEPT"]

INHERITED = "fd:"  # --socket=fd:N: listen on this inherited TCP socket, through a gate
ACCEPT = "accept"  # --coordinator=accept: the proxy dials the channel in through the gate

REGISTER_WAIT = 30.0
REJOIN_EVERY = 0.1  # seconds between a lost worker's looks for a new gym-proxy

log = logging.getLogger("gym_proxy.worker")


class AppServer(Protocol):
    """What serves the app: `AiohttpWorkerServer` or `AsgiWorkerServer` (`stop` once)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def http_protocol(self) -> asyncio.Protocol: ...


class _StartupFailed(Exception):
    """The worker cannot start; `code` is the process's exit status (said already)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class WorkerServer:
    """One worker incarnation. `stop`: set to stop it; without one, SIGTERM does (the
    process is this worker's). Tests run workers as tasks with their own `stop`
    (`tests/in_process.py`): one process, one SIGTERM, many workers."""

    # Opened by startup, in this order (each close registered on `resources`).
    app: Any
    runtime: ParticipantRuntime
    server: AppServer
    channel: Channel  # to the coordinator: another one after a rejoin
    channel_task: asyncio.Task[None]

    def __init__(self, args: WorkerArgs, stop: asyncio.Event | None = None) -> None:
        self.args = args
        self.own_process = stop is None
        self.stop = asyncio.Event() if stop is None else stop
        self.proxy_stopping = asyncio.Event()  # it stops for good: leave no worker waiting
        self.resources = contextlib.AsyncExitStack()
        self.gate_socket = _inherited_socket(args.socket)
        address = args.socket if self.gate_socket is None else address_of(self.gate_socket)
        self.info = WorkerInfo(args.slot, args.owner, os.getpid(), address)
        self.gate: LinkGate | None = None  # placed on another node: its port

    async def run(self) -> int:
        """Start, serve until stopped or the coordinator is lost for good, then drain;
        answers the process's exit status."""
        try:
            await self.startup()
        except _StartupFailed as exc:
            code = exc.code
        else:
            try:
                code = await self.serve()
            except asyncio.CancelledError:
                # A worker run as a task, killed: its channel goes first, as a killed
                # process's would, so the proxy stops routing to it at once.
                self._close_channel()
                raise
            await self.shutdown()
        finally:
            await self.resources.aclose()
        return code

    # ---- startup ------------------------------------------------------------------
    async def startup(self) -> None:
        """Open everything in order, each close registered as it opens; return once
        registered. _StartupFailed (with the exit status) when it cannot."""
        await self._start_app()
        if self.own_process:
            freeze_startup_heap()
            loop = asyncio.get_running_loop()
            # The process's own, for as long as it runs: a second SIGTERM changes nothing.
            loop.add_signal_handler(signal.SIGTERM, self.stop.set)
            # Ctrl-C reaches the whole process group; the proxy decides and sends SIGTERM.
            loop.add_signal_handler(signal.SIGINT, lambda: None)
        try:
            await self._register(rejoining=False)
        except (OSError, TimeoutError, ChannelClosed, ChannelTimeout, RemoteError) as exc:
            why = str(exc) or "the proxy did not dial in"
            log.error("worker %d could not register with the coordinator: %s", self.args.slot, why)
            raise _StartupFailed(LOST_COORDINATOR) from None
        self.resources.callback(self._close_channel)
        log.debug("worker %d registered as %s", self.info.slot, self.info.owner)
        self._start_timers()

    async def _start_app(self) -> None:
        """Build the app and serve it, on its socket or behind the gate; BOOT_ERROR when
        it cannot."""
        args, resources = self.args, self.resources
        try:
            self.app = await build_app(args.app, args.app_dir, args.workers, args.session_state)
            socket_path = None if self.gate_socket is not None else args.socket
            self.runtime, self.server = _host(self.app, self.info, args, socket_path)
            await self.server.start()
            resources.push_async_callback(self.server.stop)
            if self.gate_socket is not None:
                http = self.server.http_protocol
                self.gate = LinkGate(self.gate_socket, _link_key(), http, self.stop.set)
                await self.gate.start()
                resources.callback(self.gate.close)
        except NemoGymConfigError as exc:  # a mistake in the flags or config: no traceback
            why = f"cannot start app {args.app}: {exc}"
            print(f"gym-proxy worker {args.slot}: {why}", file=sys.stderr)
            raise _StartupFailed(BOOT_ERROR) from None
        except Exception:
            traceback.print_exc()
            print(f"gym-proxy worker {args.slot}: cannot start app {args.app}", file=sys.stderr)
            raise _StartupFailed(BOOT_ERROR) from None

    def _start_timers(self) -> None:
        """The loop-lag sampler, telemetry and the idle sessions' expiry, once serving."""
        args, info, runtime, resources = self.args, self.info, self.runtime, self.resources
        runtime.loop_lag.start()
        resources.callback(runtime.loop_lag.stop)
        name = f"{args.instance}-w{info.slot}-{info.owner}"
        telemetry.start(args.instance, name, **{"gym_proxy.slot": str(info.slot)})
        resources.callback(telemetry.shutdown)
        runtime.moved_away.idle_ttl = args.session_idle_ttl
        if args.session_idle_ttl > 0:
            expiry = asyncio.create_task(runtime.ends.expire(args.session_idle_ttl))
            resources.callback(expiry.cancel)

    # ---- the coordinator ----------------------------------------------------------
    async def _register(self, rejoining: bool, within: float = REGISTER_WAIT) -> None:
        """Connect to the coordinator (placed: take the channel the proxy dials in through
        the gate, waiting `within` seconds for it), register, and take the reply's
        tables; raises OSError, TimeoutError, ChannelClosed, ChannelTimeout or RemoteError
        (refused)."""
        runtime = self.runtime
        if self.gate is not None:
            reader, writer = await self.gate.next_channel(within, self.stop)
        else:
            path = self.args.coordinator
            reader, writer = await asyncio.open_unix_connection(path, limit=STREAM_LIMIT)
        channel = Channel(reader, writer, self._handle)
        channel.pong = lambda: Pong(
            runtime.loop_lag.take_worst("ping"), resident_bytes(), len(runtime.store)
        )
        channel_task = asyncio.create_task(channel.serve())
        try:
            reply = await channel.request(self._registration(rejoining), within=REGISTER_WAIT)
        except BaseException:
            channel.close()
            channel_task.cancel()
            raise
        self.channel, self.channel_task = channel, channel_task
        runtime.channel = channel
        if rejoining:
            # The claims this worker still lists stay: the new coordinator reads their records
            # again from the checkpoint (coordinator/claims_recovery.py), or refuses the
            # replacement (409 stale_attempt), never running it from its start in silence.
            runtime.marks.merge(reply.tables.marks)
        else:
            apply_tables(runtime, reply.tables)
        if reply.checkpoint_id is not None:
            runtime.close_door(reply.checkpoint_id)
        elif rejoining and not runtime.is_open:
            # The checkpoint that closed the door died with the old proxy: the new one
            # reports itself idle, and a controller that goes on is refused and starts again.
            runtime.open_door()

    def _registration(self, rejoining: bool) -> Register:
        info, runtime = self.info, self.runtime
        return Register(
            slot=info.slot,
            owner=info.owner,
            pid=info.pid,
            socket=info.socket_path,
            kind=runtime.kind,
            framework="aiohttp" if isinstance(self.app, web.Application) else "asgi",
            app_cookie=app_session_cookie(self.app),
            restart_only=runtime.participation.restart_only,
            rejoining=rejoining,
            held=runtime.store.last_used() if rejoining else {},
            marks=runtime.marks.as_dict() if rejoining else {},
            expected=runtime.claims.attempts() if rejoining else {},
        )

    async def _handle(self, message: Message) -> Message:
        if isinstance(message, ProxyStopping):
            self.proxy_stopping.set()
            self.runtime.stop_waiting()
            return Done()
        return await handle_coordinator_message(self.runtime, message)

    def _close_channel(self) -> None:
        self.channel.close()
        self.channel_task.cancel()

    # ---- serve --------------------------------------------------------------------
    async def serve(self) -> int:
        """Serve until stopped or the proxy stops for good (0), or the coordinator is
        lost and no gym-proxy adopts the worker (LOST_COORDINATOR, 0 if stopped
        meanwhile)."""
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            while True:
                await asyncio.wait(
                    {self.channel_task, stopped}, return_when=asyncio.FIRST_COMPLETED
                )
                if self.stop.is_set() or self.proxy_stopping.is_set():
                    return 0  # a gym-proxy that stops for good leaves no worker waiting for it
                self._close_channel()
                if not await self._rejoin():
                    return 0 if self.stop.is_set() else LOST_COORDINATOR
        finally:
            stopped.cancel()

    async def _rejoin(self) -> bool:
        """The coordinator is gone. With `--orphan-grace`, keep the sessions and the
        requests running, and register with a gym-proxy started again on the same
        coordinator socket within the grace (placed: with the one that dials a channel in
        through the gate); False when none did (or it refused, or a stop came)."""
        slot, grace = self.info.slot, self.args.orphan_grace or 0.0
        if grace <= 0:
            log.warning("worker %d lost the coordinator; stopping", slot)
            return False
        log.warning(
            "worker %d lost the coordinator; keeping its %d sessions up to %g s for a "
            "gym-proxy started again with the same --runtime-dir to adopt it",
            slot,
            len(self.runtime.store),
            grace,
        )
        deadline = time.monotonic() + grace
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                await self._register(
                    True, max(0.0, min(REGISTER_WAIT, deadline - time.monotonic()))
                )
            except RemoteError as exc:
                log.error("worker %d: the new gym-proxy refused to adopt it: %s", slot, exc)
                return False
            except (OSError, ChannelClosed, ChannelTimeout):
                # Nobody listens yet (or the socket is the dead proxy's): look again shortly.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), REJOIN_EVERY)
                continue
            log.warning("worker %d adopted by the new gym-proxy", slot)
            return True
        if not self.stop.is_set():
            log.warning("worker %d: no gym-proxy adopted it within %g s; stopping", slot, grace)
        return False

    # ---- shut down ----------------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop accepting (the gate) and drain the app within the graceful timeout while
        the channel is still up (a request finishing may still claim, report or end a
        session); the resources then close, the gate and the app server with nothing
        left to do."""
        if self.gate is not None:
            self.gate.close()
        await self.server.stop()


async def serve(args: WorkerArgs, stop: asyncio.Event | None = None) -> int:
    """Run the worker until `stop` is set (without one, until SIGTERM) or the
    coordinator goes away; return the exit code (`WorkerServer`)."""
    return await WorkerServer(args, stop).run()


def _host(
    app: Any, info: WorkerInfo, args: WorkerArgs, socket_path: str | None
) -> tuple[ParticipantRuntime, AppServer]:
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


def _inherited_socket(option: str) -> socket.socket | None:
    """The socket a placed worker's host passed down (`--socket=fd:N`: TCP, or Unix on
    gym-proxy's node), else None."""
    if not option.startswith(INHERITED):
        return None
    return socket.socket(fileno=int(option[len(INHERITED) :]))


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
