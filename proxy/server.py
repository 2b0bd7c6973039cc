"""The proxy process: runtime directory, control app, coordinator, workers, public port.

Start order: private runtime directory (0700), control app on its socket, coordinator
socket, the workers (all registered), then the public port listens ("ready on"); an
inherited, listening socket (--fd) serves from the start, answering 503
`worker_unavailable` until then. Stop order
(SIGTERM/SIGINT; a second signal skips the drain): stop accepting, let in-flight requests
finish within the grace period, cut the rest, stop workers, remove the runtime directory.
Once ready, HUP restarts the workers one by one, TTIN adds one and TTOU removes one
(`proxy.fleet.operations`), their sessions moved, never dropped; before ready and while
stopping each is logged as ignored (held from the process's start: `proxy.cli`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import time
from typing import Any

from aiohttp import web

from gym_proxy.coordinator.checkpointer import Checkpointer
from gym_proxy.coordinator.claims_recovery import RESTORED_NAME
from gym_proxy.coordinator.contract import telemetry
from gym_proxy.coordinator.contract.channel import Channel, ChannelClosed
from gym_proxy.coordinator.contract.exit_codes import BOOT_ERROR, USAGE_ERROR
from gym_proxy.coordinator.contract.keepalive import POOL_IDLE
from gym_proxy.coordinator.contract.messages import ProxyStopping, Register, RegisterReply
from gym_proxy.coordinator.exclusion import Exclusion
from gym_proxy.coordinator.worker_channels import WorkerChannels
from gym_proxy.proxy import data_path
from gym_proxy.proxy.cli import OPERATION_SIGNALS, hold_operation_signals, release_operation_signals
from gym_proxy.proxy.config import Config, metrics_address
from gym_proxy.proxy.control.app import create_control_app
from gym_proxy.proxy.data_path.client_connection import (
    DISCARDING,
    LINGERING,
    TUNNELING,
    ClientConnection,
    ProxyState,
)
from gym_proxy.proxy.data_path.routing import Router, WorkerRoute
from gym_proxy.proxy.data_path.session_tokens import TokenCodec
from gym_proxy.proxy.data_path.upstream import UpstreamPool
from gym_proxy.proxy.descriptor_budget import (
    CHANNEL_MARGIN,
    CONTROL_CONNECTIONS,
    connection_cap,
    reserve,
)
from gym_proxy.proxy.fleet.mover import Mover
from gym_proxy.proxy.fleet.operations import Operations
from gym_proxy.proxy.fleet.supervisor import Supervisor, WorkerBootError
from gym_proxy.proxy.fleet.worker_records import WorkerLauncher
from gym_proxy.proxy.metrics.listener import MetricsListener
from gym_proxy.proxy.metrics.registry import Metrics
from gym_proxy.proxy.metrics.request_spans import RequestSpans
from gym_proxy.proxy.ray_cluster.cluster import (
    HEAD_SOCKET,
    RAY_ERROR,
    RayCluster,
    RayError,
    RayPlan,
)
from gym_proxy.proxy.runtime_dir import (
    RuntimeDir,
    RuntimeDirBusy,
    RuntimeDirLocked,
    adoptable_name,
    live_workers_in,
    remove_stale,
    secret_fingerprint,
    waiting_workers,
)
from gym_proxy.proxy.takeover import TAKEOVER_NAME, TakeOverListener
from gym_proxy.worker.nemo_gym_server import CONFIG_DICT_ENV, with_ray_address

__all__ = ["run"]

log = logging.getLogger("gym_proxy")

SWEEP_INTERVAL = 1.0
TAKEOVER_WAIT = 30.0  # seconds --take-over waits for the running instance's directory
LINGER = 2.0  # a refused client gets this long (since its last byte) to stop sending


async def run(
    config: Config,
    listen_sock: socket.socket,
    secret: bytes,
    ray_plan: RayPlan | None = None,
    launcher: WorkerLauncher | None = None,
) -> int:
    """Serve until a signal or a fatal worker error; return the process exit code.
    `ray_plan`: the Ray cluster the workers join (`proxy.ray_cluster.cluster`), if they use Ray.
    `launcher`: what starts the workers, if not a subprocess each (or the zygote)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    force = asyncio.Event()

    stopping_since = 0.0  # monotonic time of the first SIGTERM/SIGINT (or of a fatal error)

    def on_signal() -> None:
        nonlocal stopping_since
        if stop.is_set():
            force.set()
        stopping_since = stopping_since or time.monotonic()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    accepting_signals = False

    def on_operation_signal(name: str) -> None:
        if accepting_signals and not stop.is_set():
            operations.on_signal(name)
        else:
            log.warning("SIG%s ignored: gym-proxy is not serving (starting or stopping)", name)

    for sig in OPERATION_SIGNALS:
        loop.add_signal_handler(sig, on_operation_signal, sig.name.removeprefix("SIG"))
    # Held since the process began (proxy.cli): one that came meanwhile is logged now.
    release_operation_signals()

    telemetry.start(config.instance, f"{config.instance}-proxy", **{"gym_proxy.role": "proxy"})
    reserved = reserve(config.workers, metrics=config.metrics is not None)
    max_connections = connection_cap(config.max_connections, reserved)
    for stale in remove_stale(config.runtime_dir):
        log.info("removed the runtime directory of a dead instance: %s", stale)
    # Taking over, the running instance lets the directory go once its workers are free.
    deadline = time.monotonic() + (TAKEOVER_WAIT if config.take_over else 0.0)
    while True:
        try:
            runtime = _runtime_dir(config, secret, listen_sock)
            break
        except RuntimeDirLocked as exc:
            if time.monotonic() >= deadline:
                log.error("%s; stopping", exc)
                return USAGE_ERROR
            await asyncio.sleep(0.01)
        except RuntimeDirBusy as exc:
            log.error("%s; stopping", exc)
            return USAGE_ERROR
    coordinator_socket = runtime.join("coordinator.sock")
    control_socket = runtime.join("control.sock")
    router = Router()
    control = WorkerRoute(
        "control", -1, control_socket, pool=UpstreamPool(control_socket, limit=CONTROL_CONNECTIONS)
    )
    state = ProxyState(
        router=router,
        codec=TokenCodec(secret, config.instance),
        cookie_name=config.session_cookie.encode(),
        control=control,
        upstream_timeout=config.upstream_timeout,
        keepalive_timeout=config.keepalive_timeout,
        header_timeout=config.header_timeout,
        tunnel_idle_timeout=config.tunnel_idle_timeout,
        limit_request_line=config.limit_request_line,
        limit_request_head=config.limit_request_headers,
        max_connections=max_connections,
        now=loop.time(),
        clock=loop.time,
        access_log=_access_logger("gym_proxy.access") if config.access_log else None,
    )
    if config.trace_requests:
        if telemetry.enabled():
            state.request_spans = RequestSpans()
        else:
            log.warning("--trace-requests needs NeMo Gym's telemetry on (NEMO_GYM_OTEL_ENABLED)")
    supervisor = Supervisor(config, runtime.path, coordinator_socket, router, launcher=launcher)
    for path, instance in waiting_workers(config.runtime_dir).items():
        if path != runtime.path:  # another instance's, or this one's at another address
            log.warning(
                "the workers of a dead gym-proxy (instance %r) wait in %s; this one is %r at "
                "%s: it does not adopt them (start that command again; they stop when their "
                "--orphan-grace ends)",
                instance,
                path,
                config.instance,
                _bound_address(listen_sock),
            )
    # A dead instance's directory where a worker still listens: its workers wait to rejoin.
    supervisor.orphans = live_workers_in(runtime.path) if runtime.found is not None else 0
    supervisor.adopting = supervisor.orphans > 0
    if supervisor.adopting:
        previous = "the handing-over" if config.take_over else "a dead"
        log.info("adopting the workers %s instance left in %s", previous, runtime.path)
        supervisor.take_intent()
    checkpointer = Checkpointer(supervisor, config.instance, config.lease_grace)
    if config.orphan_grace:  # a successor may have to continue what a restore left
        checkpointer.restored_note = runtime.join(RESTORED_NAME)

    def on_register(registration: Register, channel: Channel) -> RegisterReply:
        supervisor.on_register(registration, channel)
        return checkpointer.register_reply(registration)

    def on_lost(owner: str) -> None:
        supervisor.on_lost(owner)
        checkpointer.on_lost(owner)

    worker_channels = WorkerChannels(
        on_register,
        on_lost,
        checkpointer.on_message,
        limit=lambda: len(supervisor.workers()) + CHANNEL_MARGIN,
    )
    mover = Mover(supervisor, checkpointer.exclusion)
    operations = Operations(supervisor, mover, checkpointer.exclusion)
    supervisor.on_recycle = operations.recycle
    metrics = Metrics(state, supervisor, checkpointer, mover, operations)
    control_runner = web.AppRunner(
        create_control_app(
            checkpointer, config.control_token, mover, operations, metrics.observe_checkpoint
        ),
        access_log=None,
        handle_signals=False,
    )
    metrics_listener: MetricsListener | None = None
    cluster: RayCluster | None = None
    server: asyncio.AbstractServer | None = None
    timers: list[asyncio.Task[None]] = []
    takeover: TakeOverListener | None = None
    handed_over = False  # to a new gym-proxy (--take-over): the workers and the directory go on
    code = 0
    try:
        log.info("runtime directory %s", runtime.path)
        await control_runner.setup()
        await web.UnixSite(control_runner, control_socket).start()
        if config.metrics is not None:
            metrics_sock = _bind(*metrics_address(config.metrics, config.host))
            metrics_listener = MetricsListener(
                metrics.render, config.header_timeout, config.keepalive_timeout
            )
            await metrics_listener.start(metrics_sock)
            metrics.loop_lag.start()
            host, port = metrics_sock.getsockname()[:2]
            log.info("metrics on http://%s:%d/metrics", host, port)
        await worker_channels.start(coordinator_socket)

        # A port gym-proxy bound itself listens only once every worker has registered:
        # until then a connection is refused at once, which NeMo Gym's clients retry
        # (they retry no status code). An inherited socket (--fd) listens already, so the
        # kernel accepts connections into its backlog: those are served from the start,
        # and until every worker has registered a request is answered 503
        # worker_unavailable with Retry-After (control calls are served), never left to
        # wait. Either way "the app answers" means ready.
        def serve() -> Any:
            return loop.create_server(
                lambda: ClientConnection(state), sock=listen_sock, backlog=config.backlog
            )

        # Taking over, the socket is the running instance's: until this one has adopted
        # the workers, connections wait in its backlog rather than get a 503.
        if _listening(listen_sock) and not config.take_over:
            state.booting = True
            server = await serve()
        # Separate tasks on purpose: the data path's timers never wait on the coordinator.
        timers = [
            asyncio.ensure_future(_sweep(state, supervisor)),
            asyncio.ensure_future(_expire_leases(checkpointer)),
        ]
        cluster = (
            RayCluster(ray_plan, config.orphan_grace or 0.0, runtime.join(HEAD_SOCKET))
            if ray_plan is not None
            else None
        )
        boot = asyncio.ensure_future(_boot(supervisor, cluster))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({boot, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not boot.done():
            boot.cancel()
            log.info("stopped before the workers were ready")
            return 0
        try:
            boot.result()
        except WorkerBootError as exc:
            log.error("%s; stopping", exc)
            code = BOOT_ERROR
            return code
        except RayError as exc:
            log.error("%s; stopping", exc)
            code = RAY_ERROR
            return code
        await checkpointer.recover_claims()  # before a replacement may come to claim one
        state.booting = False
        if server is None:
            try:
                # Ours, not the loop's: uvloop closes a socket whose listen() fails and
                # raises nothing, so a port taken since the bind would go unnoticed.
                listen_sock.listen(config.backlog)
            except OSError as exc:
                log.error("cannot listen on %s: %s; stopping", _where(config), exc.strerror)
                code = USAGE_ERROR
                return code
            server = await serve()
        host, port = listen_sock.getsockname()[:2]
        count = supervisor.expected  # an adoption may have kept another count
        workers = f"{count} worker{'s' if count != 1 else ''}"
        log.info("ready on http://%s:%d with %s", host, port, workers)
        log.info("data path: %s (%s)", *data_path.mode())
        timers.append(asyncio.ensure_future(supervisor.watch_liveness()))
        taken = loop.create_future()
        if config.orphan_grace:
            takeover = TakeOverListener(
                secret_fingerprint(secret, config.instance),
                listen_sock,
                functools.partial(_taken, checkpointer.exclusion, taken),
                functools.partial(_take_over_blocked, checkpointer.exclusion),
            )
            await takeover.start(runtime.join(TAKEOVER_NAME))
        accepting_signals = True
        stopped = asyncio.ensure_future(stop.wait())
        either: set[asyncio.Future[Any]] = {stopped, supervisor.fatal, taken}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if supervisor.fatal.done():
            log.error("%s; stopping", supervisor.fatal.exception())
            code = BOOT_ERROR
        server.close()
        if not taken.done():
            for worker in supervisor.live():  # none should wait for a successor
                with contextlib.suppress(ChannelClosed):
                    worker.channel.notify(ProxyStopping())
            if cluster is not None:
                cluster.stopping()
        if taken.done() and not supervisor.fatal.done():
            handed_over = True
            log.info("taken over by a new gym-proxy (pid %d): it has the port", taken.result())
            for timer in timers:  # liveness pings must not kill the workers now
                timer.cancel()
            supervisor.hand_over()
            await worker_channels.let_go()  # the workers look for the new proxy now
            if cluster is not None:
                await cluster.stop(keep=True)  # it waits for the new proxy, as they do
            runtime.release()
            handed = len(supervisor.workers())
            log.info("%d workers handed over; finishing the open connections", handed)
            await _drain(state, config.graceful_timeout, force, close_idle=False)
            return code
        await _drain(state, config.graceful_timeout, force)
        return code
    finally:
        accepting_signals = False  # the handlers stay: a signal while stopping is logged
        stopping_since = stopping_since or time.monotonic()
        operations.close()
        metrics.loop_lag.stop()
        if metrics_listener is not None:
            await metrics_listener.close()
        for timer in timers:
            timer.cancel()
        if server is not None:
            server.close()
        for client in list(state.clients):
            client.abort()
        if handed_over:
            await supervisor.let_go()
        else:
            await supervisor.stop(config.graceful_timeout)
        if takeover is not None:
            await takeover.close()
        if supervisor.fatal is not None and supervisor.fatal.done():
            supervisor.fatal.exception()  # retrieved: it was reported above
        if cluster is not None:
            await cluster.stop()  # after the workers: they were its drivers
        await worker_channels.close()
        control.pool.close()
        await control_runner.cleanup()
        if not handed_over:
            runtime.remove()
        listen_sock.close()
        telemetry.shutdown()
        # Held again before the loop closes and takes the handlers away: until the
        # process exits, a late one stays pending instead of ending it.
        hold_operation_signals()
        for sig in OPERATION_SIGNALS:
            loop.remove_signal_handler(sig)
        log.info("stopped in %.2f s", time.monotonic() - stopping_since)


def _runtime_dir(config: Config, secret: bytes, listen_sock: socket.socket) -> RuntimeDir:
    """This instance's runtime directory. With `--orphan-grace`, the one the same
    command's earlier instance used: if it died, its workers wait there to be adopted,
    which only an instance signing with the same secret may do (RuntimeDirBusy otherwise,
    the directory left as it was)."""
    if not config.orphan_grace:
        return RuntimeDir(config.runtime_dir)
    name = adoptable_name(config.instance, _bound_address(listen_sock))
    runtime = RuntimeDir(config.runtime_dir, name)
    fingerprint = secret_fingerprint(secret, config.instance)
    if runtime.found is not None and runtime.found.get("secret") != fingerprint:
        runtime.release()
        raise RuntimeDirBusy(
            f"cannot adopt the workers a dead instance left in {runtime.path}: they serve "
            "tokens signed with another secret (start with the same --secret-file)"
        )
    runtime.write_identity({"instance": config.instance, "secret": fingerprint})
    return runtime


def _bound_address(listen_sock: socket.socket) -> str:
    """The address the public socket is bound to (an inherited one's too)."""
    host, port = listen_sock.getsockname()[:2]
    return f"{host}:{port}"


async def _boot(supervisor: Supervisor, cluster: RayCluster | None) -> None:
    """Start the workers, joined to the server's one Ray cluster when they use Ray: it is
    started or checked first, and named in the config every worker is given."""
    if cluster is not None:
        await cluster.start()
        os.environ[CONFIG_DICT_ENV] = with_ray_address(os.environ[CONFIG_DICT_ENV], cluster.address)
        os.environ.update(cluster.environment)
    await supervisor.start()


def _bind(host: str, port: int) -> socket.socket:
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


def _take_over_blocked(exclusion: Exclusion) -> str | None:
    """Why a take-over must wait: what runs here whose state the new gym-proxy would not
    have (the controller, or the operator, finishes it first)."""
    open_id = exclusion.open_checkpoint()
    if open_id is not None:
        return f"checkpoint {open_id} is open; take over after its resume"
    if exclusion.operation is not None:
        return f"a {exclusion.operation} is running; take over after it"
    return None


def _taken(exclusion: Exclusion, taken: asyncio.Future[int], pid: int) -> None:
    """Taken over: from now on a checkpoint or an operation here is refused (409 naming
    the take-over), so none starts that the new gym-proxy would not know."""
    exclusion.operation = "take-over"
    taken.set_result(pid)


def _where(config: Config) -> str:
    return f"{config.host}:{config.port}"


def _listening(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def _access_logger(name: str) -> logging.Logger:
    """The access log logs whatever --log-level says (asking for it is asking for it)."""
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    return logger


async def _drain(
    state: ProxyState, grace: float, force: asyncio.Event, close_idle: bool = True
) -> None:
    """Close idle connections now and busy ones after their response, within `grace`.
    Handed over (`close_idle` false), an idle connection is closed after its next
    response instead: closing it now could race the client's next request on it."""
    state.draining = True
    state.drained = asyncio.Event()
    for client in list(state.clients):
        if close_idle and not client.pipeline:
            client.close()
    if not state.clients:
        log.info("shutting down: no request in flight")
        return
    log.info(
        "shutting down: waiting up to %g s for %d connections with requests in flight",
        grace,
        len(state.clients),
    )
    waits = {asyncio.ensure_future(state.drained.wait()), asyncio.ensure_future(force.wait())}
    _, pending = await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if state.clients:
        log.warning("cutting %d connections still busy after the grace period", len(state.clients))


async def _sweep(state: ProxyState, supervisor: Supervisor) -> None:
    """Advance the coarse clock; expire slow heads, idle clients, stalled upstreams and idle
    pool entries. Never awaits anything but its own timer."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(SWEEP_INTERVAL)
        now = state.now = loop.time()
        idle_before = now - state.keepalive_timeout
        head_before = now - state.header_timeout if state.header_timeout else None
        discard_before = now - (state.header_timeout or state.keepalive_timeout)
        stall_before = now - state.upstream_timeout if state.upstream_timeout else None
        linger_before = now - LINGER
        tunnel_before = now - state.tunnel_idle_timeout
        for client in list(state.clients):
            phase = client.phase
            if phase == LINGERING:
                if client.last_active < linger_before:
                    client.abort()
                continue
            if phase == TUNNELING:
                if client.last_active < tunnel_before:
                    client.tunnel_timed_out()
                continue
            since = client.head_since
            if (
                head_before is not None
                and since is not None
                and since < head_before
                and not client.read_pause
            ):
                client.head_timed_out()
                continue
            pipeline = client.pipeline
            if not pipeline:
                if client.parsing is None:
                    if client.last_active < idle_before:
                        client.close()
                elif phase == DISCARDING and client.last_active < discard_before:
                    client.abort()  # a client that stopped sending the body we drop
                continue
            heard = pipeline[0].upstream_idle_since()
            if stall_before is not None and heard is not None and heard < stall_before:
                pipeline[0].timed_out()
        pool_before = time.monotonic() - POOL_IDLE
        for worker in supervisor.workers():
            if worker.route is not None:
                worker.route.pool.close_idle(pool_before)
        state.control.pool.close_idle(pool_before)


async def _expire_leases(checkpointer: Checkpointer) -> None:
    """Resume an open checkpoint whose lease ran out (on its own task: may wait its turn)."""
    while True:
        await asyncio.sleep(SWEEP_INTERVAL)
        if checkpointer.machine.lease_expired(checkpointer.clock()):
            await checkpointer.expire_lease()
