"""What one gym-proxy is made of, built and wired in one place (no I/O): the router and
the data path's state, the supervisor, the checkpointer, the worker channels, the move
table, the mover and the live operations, the metrics and the control app.

The server (`proxy.server`) opens and closes them; here they only learn of each other:
a worker's registration goes to the supervisor and then the checkpointer, its channel's
end to both, and its messages to the one they are for (`SessionsEnded` to the router,
reports and claims to the checkpointer).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry

from gym_proxy.coordinator.checkpointer import Checkpointer
from gym_proxy.coordinator.claims_recovery import RESTORED_NAME
from gym_proxy.coordinator.contract import telemetry
from gym_proxy.coordinator.contract.channel import Channel
from gym_proxy.coordinator.contract.messages import Message, Register, RegisterReply, SessionsEnded
from gym_proxy.coordinator.exclusion import Exclusion
from gym_proxy.coordinator.worker_channels import WorkerChannels
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.control.app import create_control_app
from gym_proxy.proxy.data_path.client_connection import ProxyState
from gym_proxy.proxy.data_path.routing import Router, WorkerRoute
from gym_proxy.proxy.data_path.session_tokens import TokenCodec
from gym_proxy.proxy.data_path.upstream import UpstreamPool
from gym_proxy.proxy.descriptor_budget import (
    CHANNEL_MARGIN,
    CONTROL_CONNECTIONS,
    connection_cap,
    reserve,
)
from gym_proxy.proxy.fleet.balance.autoscale import Autoscaler, ScalePolicy
from gym_proxy.proxy.fleet.balance.balancer import Balancer, bounds_of, thresholds_of
from gym_proxy.proxy.fleet.moves.move_table import MoveTable
from gym_proxy.proxy.fleet.moves.mover import Mover
from gym_proxy.proxy.fleet.operations.live import Operations
from gym_proxy.proxy.fleet.supervision.intent import KeptIntent
from gym_proxy.proxy.fleet.supervision.launchers import WorkerLauncher
from gym_proxy.proxy.fleet.supervision.supervisor import Supervisor
from gym_proxy.proxy.metrics.durations import Durations
from gym_proxy.proxy.metrics.registry import Metrics
from gym_proxy.proxy.metrics.request_spans import RequestSpans
from gym_proxy.proxy.runtime_dir import RuntimeDir

__all__ = ["Assembly"]

log = logging.getLogger("gym_proxy")

CONTROL_SOCKET = "control.sock"
COORDINATOR_SOCKET = "coordinator.sock"


@dataclass(eq=False)
class Assembly:
    runtime: RuntimeDir
    router: Router
    state: ProxyState
    supervisor: Supervisor
    checkpointer: Checkpointer
    table: MoveTable
    mover: Mover
    operations: Operations
    metrics: Metrics
    control_runner: web.AppRunner
    balancer: Balancer  # measures load always; moves sessions with --rebalance
    exclusion: Exclusion  # checkpoints, moves, operations and the take-over: one at a time
    channels: WorkerChannels = field(init=False)

    def __post_init__(self) -> None:
        self.channels = WorkerChannels(
            self.on_register,
            self.on_lost,
            self.on_message,
            limit=lambda: len(self.supervisor.slots.workers()) + CHANNEL_MARGIN,
        )

    @classmethod
    def build(
        cls,
        config: Config,
        runtime: RuntimeDir,
        secret: bytes,
        launcher: WorkerLauncher,
    ) -> Assembly:
        intent = KeptIntent(runtime.path, config.workers)
        router = Router(on_aliases=intent.aliases_changed)
        state = _proxy_state(config, router, secret, runtime.join(CONTROL_SOCKET))
        coordinator_socket = runtime.join(COORDINATOR_SOCKET)
        supervisor = Supervisor(config, runtime.path, coordinator_socket, router, intent, launcher)
        exclusion = Exclusion()
        # With a successor to come, it may have to continue what a restore left.
        note = runtime.join(RESTORED_NAME) if config.orphan_grace else None
        checkpointer = Checkpointer(
            supervisor, router, config.instance, config.lease_grace, exclusion=exclusion,
            restored_note=note,
        )  # fmt: skip
        registry = CollectorRegistry(auto_describe=True)
        durations = Durations(registry)
        table = MoveTable(router, on_held=durations.held)
        mover = Mover(supervisor, table, exclusion)
        operations = Operations(supervisor, mover, exclusion, observe=durations.operation)
        bounds = bounds_of(config)
        autoscaler = None
        if bounds is not None:
            count = lambda: len(supervisor.slots)  # noqa: E731
            autoscaler = Autoscaler(ScalePolicy(bounds), operations.resize, count)
        balancer = Balancer(
            lambda: supervisor.slots, mover, exclusion, thresholds_of(config),
            acting=config.rebalance, autoscaler=autoscaler,
            taking_over=lambda: supervisor.passing_on,
        )  # fmt: skip
        metrics = Metrics(state, supervisor, checkpointer, mover, operations, balancer, registry)
        control_app = create_control_app(
            checkpointer, config.control_token, mover, operations, durations.checkpoint,
            balancer,
        )  # fmt: skip
        control_runner = web.AppRunner(control_app, access_log=None, handle_signals=False)
        return cls(
            runtime, router, state, supervisor, checkpointer, table, mover, operations, metrics,
            control_runner, balancer, exclusion,
        )  # fmt: skip

    async def open_control_site(self) -> None:
        """The control app listens on its socket in the runtime directory."""
        await web.UnixSite(self.control_runner, self.runtime.join(CONTROL_SOCKET)).start()

    def routes(self) -> list[WorkerRoute]:
        """Every route whose pool the data path uses: each worker's, and the control app's."""
        routes = [w.route for w in self.supervisor.slots.workers() if w.route is not None]
        return [*routes, self.state.control]

    def on_register(self, registration: Register, channel: Channel) -> RegisterReply:
        self.supervisor.on_register(registration, channel)
        return self.checkpointer.register_reply(registration)

    def on_lost(self, owner: str) -> None:
        self.supervisor.on_lost(owner)
        self.checkpointer.on_lost(owner)

    async def on_message(self, owner: str, message: Message) -> Message | None:
        if isinstance(message, SessionsEnded):
            self.router.forget_sessions(owner, message.session_ids)
            return None
        return await self.checkpointer.on_message(owner, message)


def _proxy_state(config: Config, router: Router, secret: bytes, control_socket: str) -> ProxyState:
    """The data path's state: its tables, limits, timeouts and clock."""
    loop = asyncio.get_running_loop()
    pool = UpstreamPool(control_socket, limit=CONTROL_CONNECTIONS)
    reserved = reserve(config.workers, metrics=config.metrics is not None)
    state = ProxyState(
        router=router,
        codec=TokenCodec(secret, config.instance),
        cookie_name=config.session_cookie.encode(),
        control=WorkerRoute("control", -1, control_socket, pool=pool),
        upstream_timeout=config.upstream_timeout,
        keepalive_timeout=config.keepalive_timeout,
        header_timeout=config.header_timeout,
        tunnel_idle_timeout=config.tunnel_idle_timeout,
        limit_request_line=config.limit_request_line,
        limit_request_head=config.limit_request_headers,
        max_connections=connection_cap(config.max_connections, reserved),
        now=loop.time(),
        clock=loop.time,
        access_log=_access_logger() if config.access_log else None,
    )
    if config.trace_requests:
        if telemetry.enabled():
            state.request_spans = RequestSpans()
        else:
            log.warning("--trace-requests needs NeMo Gym's telemetry on (NEMO_GYM_OTEL_ENABLED)")
    return state


def _access_logger() -> logging.Logger:
    """The access log logs whatever --log-level says (asking for it is asking for it)."""
    logger = logging.getLogger("gym_proxy.access")
    logger.setLevel(logging.INFO)
    return logger
