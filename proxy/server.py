"""The proxy process's life cycle, as uvicorn's `Server` has it: `startup`, `serve`, then
`pass_on` (the workers, to a `--take-over` successor) or `shutdown`; `run` does all of
it.

Start order: the runtime directory (0700), the Ray cluster (with `--worker-placement
ray`) and the worker launcher (a subprocess each, the zygote, or Ray's), the control app
on its socket, the metrics listener, the coordinator socket, the workers (the launcher
opened with their declared environment, then all registered), then the public port
listens ("ready on"); an inherited, listening socket (--fd) serves from the start,
answering 503 `worker_unavailable` until then. Each resource registers its own close as
it opens (an `AsyncExitStack`, as aiohttp's `BaseRunner.cleanup` does), so the teardown
is the start read backwards and a new resource cannot be forgotten in it; a resource
passed on (the workers, the runtime directory, the Ray cluster) was let go first, and
its close then has nothing left to do.

Stop (SIGTERM/SIGINT; a second signal skips the drain): stop accepting, let in-flight
requests finish within the grace period, cut the rest, then the resources close: the
workers stop, the runtime directory goes. Once serving, HUP restarts the workers one by
one, TTIN adds one and TTOU removes one (`proxy.signals`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

from gym_proxy.coordinator.contract import telemetry
from gym_proxy.coordinator.contract.channel import ChannelClosed
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.exit_codes import BOOT_ERROR, RAY_ERROR, USAGE_ERROR
from gym_proxy.coordinator.contract.messages import ProxyStopping
from gym_proxy.proxy import data_path
from gym_proxy.proxy.assembly import Assembly
from gym_proxy.proxy.config import Config, metrics_address
from gym_proxy.proxy.connection_sweep import sweep_connections
from gym_proxy.proxy.control.app import server_status
from gym_proxy.proxy.data_path.client_connection import ClientFactory
from gym_proxy.proxy.fleet.balance.autoscale import RESIZE_WITHIN
from gym_proxy.proxy.fleet.supervision.launchers import FindsLeftWorkers, WorkerLauncher
from gym_proxy.proxy.fleet.supervision.liveness import watch_liveness
from gym_proxy.proxy.fleet.supervision.supervisor import Supervisor, WorkerBootError
from gym_proxy.proxy.launch import WorkerPlan, choose_launcher, launch_of
from gym_proxy.proxy.metrics import listener as metrics_listener
from gym_proxy.proxy.metrics import status_page
from gym_proxy.proxy.ray_cluster.cluster import HEAD_SOCKET, RayCluster
from gym_proxy.proxy.ray_cluster.errors import RayError
from gym_proxy.proxy.runtime_dir import (
    RuntimeDir,
    RuntimeDirBusy,
    live_workers_in,
    open_runtime_dir,
    secret_fingerprint,
)
from gym_proxy.proxy.signals import Signals
from gym_proxy.proxy.take_over import TAKE_OVER_SOCKET, PassOnListener, TakeOver, until_released

__all__ = ["Server", "StartupFailed", "run"]

log = logging.getLogger("gym_proxy")


class StartupFailed(Exception):
    """The server cannot start; `code` is the process's exit status (logged, one line)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _StoppedEarly(Exception):
    """A TERM/INT came before the workers were ready."""


class Server:
    """One gym-proxy. `plan`: what the workers' environment declares and the Ray cluster
    they join, if they use Ray; `launcher`: what starts them, if not the one the config
    asks for (a test's); `take_over`: the socket and conversation a `--take-over` got
    from the running instance."""

    def __init__(
        self,
        config: Config,
        listen_sock: socket.socket,
        secret: bytes,
        plan: WorkerPlan | None = None,
        launcher: WorkerLauncher | None = None,
        take_over: TakeOver | None = None,
    ) -> None:
        self.config = config
        self.listen_sock = listen_sock
        self.secret = secret
        self.plan = plan or WorkerPlan()
        self.launcher = launcher
        self.take_over = take_over
        self.signals = Signals(self._on_operation_signal)
        self.resources = contextlib.AsyncExitStack()
        self.parts: Assembly | None = None  # what the server is made of, once built
        self.fingerprint = secret_fingerprint(secret, self.config.instance)
        self.runtime: RuntimeDir | None = None
        self.cluster: RayCluster | None = None
        self.public: asyncio.AbstractServer | None = None
        self.pass_on_listener: PassOnListener | None = None
        self.successor: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._timers: list[asyncio.Task[None]] = []  # stop before the workers do

    async def run(self) -> int:
        """Start, serve until a signal, a fatal worker error or a take-over, then pass
        the workers on or shut down; answers the process's exit status."""
        try:
            await self.startup()
        except StartupFailed as exc:
            log.error("%s; stopping", exc)
            code = exc.code
        except _StoppedEarly:
            log.info("stopped before the workers were ready")
            code = 0
        else:
            code = await self.serve()
            self.signals.note_stopping()
            if self.successor.done() and code == 0:
                await self.pass_on()
            else:
                await self.shutdown()
        finally:
            self.signals.note_stopping()
            await self.resources.aclose()
        log.info("stopped in %.2f s", time.monotonic() - self.signals.stopping_since)
        return code

    # ---- startup ------------------------------------------------------------------
    async def startup(self) -> None:
        """Open everything in order, each close registered as it opens; return once the
        public port listens. StartupFailed (with the exit status) when it cannot."""
        config, resources = self.config, self.resources
        self.signals.install()
        resources.callback(self.signals.remove)
        telemetry.start(config.instance, f"{config.instance}-proxy", **{"gym_proxy.role": "proxy"})
        resources.callback(telemetry.shutdown)
        resources.callback(self.listen_sock.close)
        self.runtime = await self._open_runtime_dir()
        resources.callback(self.runtime.remove)
        if self.plan.ray is not None:  # started at boot; stopped after the workers' launcher
            keep_for = config.orphan_grace or 0.0
            self.cluster = RayCluster(self.plan.ray, keep_for, self.runtime.join(HEAD_SOCKET))
            resources.push_async_callback(self.cluster.stop)
        launcher = self.launcher or choose_launcher(config, self.secret, self.runtime.path)
        resources.push_async_callback(launcher.close)  # after the workers stopped
        parts = self.parts = Assembly.build(config, self.runtime, self.secret, launcher)
        resources.callback(parts.operations.close)
        await self._open_listeners(parts)
        # A port gym-proxy bound itself listens only once every worker has registered:
        # until then a connection is refused at once, which NeMo Gym's clients retry
        # (they retry no status code). An inherited socket (--fd) listens already, so the
        # kernel accepts connections into its backlog: those are served from the start,
        # answered 503 worker_unavailable with Retry-After until every worker has
        # registered (control calls are served), never left to wait. Taking over, the
        # socket is the running instance's: connections wait in its backlog until this
        # one has adopted the workers.
        if _listening(self.listen_sock) and self.take_over is None:
            parts.state.booting = True
            await self._serve_public()
        self._timer(sweep_connections(parts.state, parts.routes))
        self._timer(parts.checkpointer.watch_lease())
        await self._boot(parts)
        await parts.checkpointer.recover_claims()  # before a replacement may come to claim one
        parts.state.booting = False
        if self.public is None:
            await self._listen()
        host, port = self.listen_sock.getsockname()[:2]
        count = parts.supervisor.expected  # an adoption may have kept another count
        log.info("ready on http://%s:%d with %s", host, port, _workers(count))
        level = logging.WARNING if data_path.unexpected() else logging.INFO
        log.log(level, "data path: %s (%s)", *data_path.mode())
        self._timer(watch_liveness(parts.supervisor))
        self._timer(parts.operations.recycling.watch())
        self._timer(parts.balancer.watch())
        adoption = parts.supervisor.adoption
        if adoption is not None and adoption.grow_to is not None:
            self._timer(self._grow_to_kept(parts, adoption.grow_to))
        await self._open_pass_on_listener()
        self.signals.serving = True

    async def _grow_to_kept(self, parts: Assembly, workers: int) -> None:
        """The predecessor's larger worker count, reached as a resize (logged as one;
        gym-proxy's own: it gives way to a checkpoint, and its outcome says where it
        stopped)."""
        if workers <= len(parts.supervisor.slots):
            return
        try:
            await parts.operations.resize(workers, RESIZE_WITHIN, "adoption", yields=True)
        except GymError as exc:  # another operation or a checkpoint was first
            log.warning(
                "not growing to the %d workers the dead instance had: %s; resize to do it",
                workers,
                exc.detail,
            )

    async def _open_runtime_dir(self) -> RuntimeDir:
        """With --orphan-grace, the directory a predecessor's workers may wait in; taking
        over, once the running instance said it let the directory go."""
        config = self.config
        if self.take_over is not None and not await until_released(self.take_over.conversation):
            log.warning("the running gym-proxy did not say it released its runtime directory")
        fingerprint = self.fingerprint if config.orphan_grace else None
        host, port = self.listen_sock.getsockname()[:2]
        try:
            runtime = open_runtime_dir(
                config.runtime_dir, config.instance, f"{host}:{port}", fingerprint
            )
        except RuntimeDirBusy as exc:
            raise StartupFailed(USAGE_ERROR, str(exc)) from None
        log.info("runtime directory %s", runtime.path)
        return runtime

    async def _open_listeners(self, parts: Assembly) -> None:
        """The control app, the metrics listener and the coordinator socket."""
        config, resources, runtime = self.config, self.resources, parts.runtime
        await parts.control_runner.setup()
        resources.push_async_callback(parts.control_runner.cleanup)
        resources.callback(parts.state.control.pool.close)
        await parts.open_control_site()
        if config.metrics is not None:
            sock = metrics_listener.bind(*metrics_address(config.metrics, config.host))
            listener = metrics_listener.MetricsListener(
                parts.metrics.render,
                config.header_timeout,
                config.keepalive_timeout,
                pages=self._status_pages(parts),
            )
            await listener.start(sock)
            resources.push_async_callback(listener.close)
            parts.metrics.loop_lag.start()
            resources.callback(parts.metrics.loop_lag.stop)
            host, port = sock.getsockname()[:2]
            log.info("metrics on http://%s:%d/metrics, the status page at /status", host, port)
        await parts.channels.start(runtime.join("coordinator.sock"))
        resources.push_async_callback(parts.channels.close)

    def _status_pages(self, parts: Assembly) -> dict[bytes, metrics_listener.Page]:
        """The status page and what it reads (`proxy.metrics.status_page`)."""
        token = self.config.control_token
        app = parts.control_runner.app

        async def page() -> bytes:
            return status_page.PAGE

        async def status() -> bytes:
            return status_page.status_json(lambda: server_status(app), bool(token))

        return {
            b"/status": metrics_listener.Page(b"text/html; charset=utf-8", page),
            b"/status.json": metrics_listener.Page(
                b"application/json", status, guarded=bool(token), token=(token or "").encode()
            ),
        }

    async def _boot(self, parts: Assembly) -> None:
        """Start the workers (joined to the server's one Ray cluster when they use Ray:
        it is started or checked first, and named in the config every worker is given);
        adopt a predecessor's, if it left any."""
        supervisor, runtime = parts.supervisor, parts.runtime
        # A dead instance's directory where a worker still listens: its workers wait to rejoin.
        orphans = live_workers_in(runtime.path) if runtime.found is not None else 0
        if runtime.unidentified is not None and live_workers_in(runtime.path):
            # Without the identity nothing says they serve this secret's tokens.
            log.error(
                "not adopting the workers waiting in %s: %s, so nothing says they serve this "
                "secret's tokens; they stop with their sessions",
                runtime.path,
                runtime.unidentified,
            )
            supervisor.orphans_refused = (
                "nothing says it serves this gym-proxy's secret: the runtime directory's "
                "identity was not believed at start"
            )
        if orphans:
            passed_on = self.take_over is not None
            left = "the previous instance passed on" if passed_on else "a dead instance left"
            log.info("adopting the workers %s in %s", left, runtime.path)
            supervisor.adopt(orphans, passed_on)
        self.resources.push_async_callback(supervisor.stop, self.config.graceful_timeout)
        boot = asyncio.ensure_future(self._start_workers(parts))
        stopped = asyncio.ensure_future(self.signals.stop.wait())
        await asyncio.wait({boot, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not boot.done():
            boot.cancel()
            await asyncio.gather(boot, return_exceptions=True)
            raise _StoppedEarly
        try:
            boot.result()
        except WorkerBootError as exc:
            raise StartupFailed(BOOT_ERROR, str(exc)) from None
        except RayError as exc:
            raise StartupFailed(RAY_ERROR, str(exc)) from None

    async def _start_workers(self, parts: Assembly) -> None:
        """The cluster up (when the workers use Ray), the launcher open, the workers
        started and registered."""
        if self.cluster is not None:
            await self.cluster.start()
        launch = launch_of(self.plan, self.cluster, parts.channels.accept_dialed, os.environ)
        supervisor = parts.supervisor
        await supervisor.launcher.open(launch)
        await self._find_left_workers(supervisor)
        await supervisor.start()

    async def _find_left_workers(self, supervisor: Supervisor) -> None:
        """Workers a predecessor left (dead, or passing them on) where only the launcher
        sees them (on a Ray cluster's nodes) are adopted as those in the runtime
        directory are."""
        launcher = supervisor.launcher
        believed = self.runtime is not None and self.runtime.found is not None
        if not (believed and self.config.orphan_grace and isinstance(launcher, FindsLeftWorkers)):
            return
        found = await launcher.find()
        if not found:
            return
        passed_on = self.take_over is not None
        left = "the previous instance passed on" if passed_on else "a dead instance left"
        log.info("adopting the %d placed workers %s", found, left)
        if supervisor.adoption is None:
            supervisor.adopt(found, passed_on)
        else:
            supervisor.adoption.expect(found)
        launcher.dial_left()  # now that the adoption expects them

    async def _listen(self) -> None:
        try:
            # Ours, not the loop's: uvloop closes a socket whose listen() fails and raises
            # nothing, so a port taken since the bind would go unnoticed.
            self.listen_sock.listen(self.config.backlog)
        except OSError as exc:
            where = f"{self.config.host}:{self.config.port}"
            raise StartupFailed(USAGE_ERROR, f"cannot listen on {where}: {exc.strerror}") from None
        await self._serve_public()

    async def _serve_public(self) -> None:
        assert self.parts is not None
        state = self.parts.state
        self.public = await asyncio.get_running_loop().create_server(
            ClientFactory(state), sock=self.listen_sock, backlog=self.config.backlog
        )
        self.resources.callback(self._close_public)

    async def _open_pass_on_listener(self) -> None:
        """With --orphan-grace, a successor started with --take-over may ask for the
        port and the workers (`proxy.take_over`)."""
        if not self.config.orphan_grace:
            return
        assert self.parts is not None and self.runtime is not None
        self.pass_on_listener = PassOnListener(
            self.fingerprint,
            self.listen_sock,
            self._on_successor,
            self.parts.exclusion.blocking_take_over,
        )
        await self.pass_on_listener.start(self.runtime.join(TAKE_OVER_SOCKET))
        self.resources.push_async_callback(self.pass_on_listener.close)

    # ---- serve ----------------------------------------------------------------------
    async def serve(self) -> int:
        """Serve until a TERM/INT, a worker that cannot boot (BOOT_ERROR) or a take-over;
        answers the exit status so far."""
        assert self.parts is not None
        fatal = self.parts.supervisor.fatal
        stopped = asyncio.ensure_future(self.signals.stop.wait())
        either: set[asyncio.Future[Any]] = {stopped, fatal, self.successor}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        self.signals.serving = False
        if fatal.done():
            log.error("%s; stopping", fatal.exception())
            return BOOT_ERROR
        return 0

    def _on_successor(self, pid: int) -> None:
        """Taken over: from now on a checkpoint or an operation here is refused (409
        naming the take-over), so none starts that the successor would not know."""
        assert self.parts is not None
        self.parts.exclusion.operation = "take-over"
        if not self.successor.done():
            self.successor.set_result(pid)

    def _on_operation_signal(self, name: str) -> None:
        assert self.parts is not None
        self.parts.operations.on_signal(name)

    # ---- pass on / shut down --------------------------------------------------------
    async def pass_on(self) -> None:
        """Pass the workers, the Ray cluster and the runtime directory on to the
        successor that took the port, then finish the requests of the open connections
        (a successor routes everything new)."""
        assert self.parts is not None and self.runtime is not None
        parts = self.parts
        log.info("taken over by a new gym-proxy (pid %d): it has the port", self.successor.result())
        self._stop_timers()  # liveness pings must not kill the workers now
        self._stop_accepting()
        parts.supervisor.pass_on()
        launcher = parts.supervisor.launcher
        if isinstance(launcher, FindsLeftWorkers):  # before their channels end
            launcher.let_go()
        await parts.channels.let_go()  # the workers look for the new proxy now
        if self.cluster is not None:
            await self.cluster.stop(keep=True)  # it waits for the new proxy, as they do
        self.runtime.release()
        if self.pass_on_listener is not None:
            self.pass_on_listener.released()
        handed = len(parts.supervisor.slots.workers())
        log.info("%d workers passed on; finishing the open connections", handed)
        await self._drain(close_idle=False)

    async def shutdown(self) -> None:
        """Stop taking work (operations, new connections), tell the workers, drain the
        connections within the grace period; the resources then close."""
        assert self.parts is not None
        parts = self.parts
        parts.operations.close()
        self._stop_timers()
        self._stop_accepting()
        open_id = parts.checkpointer.open_checkpoint
        if open_id is not None:
            log.warning(
                "stopping with checkpoint %s open: what waits for its resume (calls at the "
                "door, parked episodes) is answered 503 server_stopping",
                open_id,
            )
        for worker in parts.supervisor.live():  # none should wait for a successor
            with contextlib.suppress(ChannelClosed):
                worker.channel.notify(ProxyStopping())
        if self.cluster is not None:
            self.cluster.stopping()
        await self._drain()

    def _stop_accepting(self) -> None:
        if self.public is not None:
            self.public.close()

    def _close_public(self) -> None:
        """No new connection, and none left open (the drain had its chance)."""
        self._stop_accepting()
        assert self.parts is not None
        for client in list(self.parts.state.clients):
            client.abort()

    async def _drain(self, close_idle: bool = True) -> None:
        """Close idle connections now and busy ones after their response, within the
        grace period (a second TERM/INT cuts it short). Handed over (`close_idle` false),
        an idle connection is closed after its next response instead: closing it now
        could race the client's next request on it."""
        assert self.parts is not None
        state, grace = self.parts.state, self.config.graceful_timeout
        state.draining = True
        state.drained = asyncio.Event()
        busy = [client for client in state.clients if client.pipeline]
        for client in list(state.clients):
            if close_idle and not client.pipeline:
                client.close()
        idle = len(state.clients) - len(busy)
        if not busy:
            log.info("shutting down: no request in flight")
        else:
            log.info(
                "shutting down: waiting up to %g s for %d connections with requests in flight%s",
                grace,
                len(busy),
                f" ({idle} idle ones closed at their next response)"
                if idle and not close_idle
                else "",
            )
        if not state.clients:
            return
        waits = {
            asyncio.ensure_future(state.drained.wait()),
            asyncio.ensure_future(self.signals.force.wait()),
        }
        _, pending = await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if state.clients:
            log.warning(
                "cutting %d connections still busy after the grace period", len(state.clients)
            )

    # ---- timers ---------------------------------------------------------------------
    def _timer(self, coro: Any) -> None:
        """A task of the server's for as long as it serves (separate tasks on purpose:
        the data path's timers never wait on the coordinator)."""
        task = asyncio.ensure_future(coro)
        self._timers.append(task)
        self.resources.callback(task.cancel)

    def _stop_timers(self) -> None:
        for task in self._timers:
            task.cancel()


async def run(
    config: Config,
    listen_sock: socket.socket,
    secret: bytes,
    plan: WorkerPlan | None = None,
    launcher: WorkerLauncher | None = None,
    take_over: TakeOver | None = None,
) -> int:
    """Serve until a signal or a fatal worker error; return the process exit code."""
    server = Server(config, listen_sock, secret, plan, launcher, take_over)
    return await server.run()


def _listening(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def _workers(count: int) -> str:
    return f"{count} worker{'s' if count != 1 else ''}"
