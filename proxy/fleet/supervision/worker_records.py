"""What the supervisor keeps of each worker process and each slot (no I/O but /proc).

A `WorkerProcess` is one incarnation: starting -> live (registered) -> dead. A `Slot`
holds at most one worker and, during a rolling restart, its successor, plus what
/metrics adds up over every incarnation of the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from gym_proxy.coordinator.contract.channel import Channel
from gym_proxy.coordinator.contract.process_memory import resident_bytes
from gym_proxy.proxy.data_path.routing import WorkerRoute
from gym_proxy.proxy.data_path.upstream import UpstreamConnection, UpstreamPool

__all__ = [
    "WorkerState",
    "WorkerStatus",
    "WORKER_STATUSES",
    "WorkerProcess",
    "WorkerHandle",
    "PlacedHandle",
    "Slot",
    "terminate",
]

log = logging.getLogger("gym_proxy.supervisor")


# starting -> live (registered) -> dead (exited, lost or killed)
WorkerState = Literal["starting", "live", "dead"]
# What a worker is to an operator (the status call, /metrics): its state and the flags an
# operation or the liveness watch set, read in one place (`WorkerProcess.status`).
WorkerStatus = Literal["booting", "ready", "draining", "unresponsive", "leaving", "stopped"]
WORKER_STATUSES: tuple[WorkerStatus, ...] = (
    "booting",
    "ready",
    "draining",
    "unresponsive",
    "leaving",
    "stopped",
)


class WorkerHandle(Protocol):
    """A started worker, as the supervisor uses it: an asyncio subprocess, one forked
    by the zygote (`proxy.fleet.supervision.zygote_client.ForkedProcess`), one adopted
    (`proxy.adopted_process.AdoptedProcess`), or a `PlacedHandle`."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int, /) -> None: ...

    def kill(self) -> None: ...


@runtime_checkable
class PlacedHandle(WorkerHandle, Protocol):
    """A worker on a node of another machine (`--worker-placement ray`:
    `proxy.ray_cluster.remote_workers.RemoteWorker`): its pid is not one of this machine's,
    it listens at `address` (`tcp://host:port`), reached through `connect` (its route's
    connector), on the Ray node `node_id`. The fleet knows placed workers only as this."""

    node_id: str

    @property
    def address(self) -> str: ...

    async def connect(
        self, factory: Callable[[], UpstreamConnection], address: str
    ) -> UpstreamConnection: ...


@dataclass(eq=False)
class WorkerProcess:
    """One worker incarnation."""

    slot: int
    owner: str
    socket_path: str
    process: WorkerHandle
    started_at: float
    state: WorkerState = "starting"
    channel: Channel | None = None
    route: WorkerRoute | None = None
    answered_at: float = 0.0  # monotonic time of the last pong (or of its first ping)
    ping: asyncio.Future[None] | None = None
    # Set when it registers, or failed with WorkerBootError when it exits before.
    registered: asyncio.Future[None] = field(default_factory=lambda: _quiet_future())
    on_trial: bool = False  # an operation started it: a boot failure fails only that
    leaving: bool = False  # an operation stops it: its exit is expected, never restarted
    started_unix: float = 0.0
    ping_seconds: float | None = None  # the last ping's round trip
    loop_lag_seconds: float = 0.0  # its worst loop lag between its last two pongs
    reported_memory: int = 0  # its resident bytes, as its last pong said (0: not said)
    reported_sessions: int = 0  # the sessions it held at its last pong

    @property
    def pid(self) -> int:
        return self.process.pid

    def go_live(self, channel: Channel, keeps_rollout_prefix: bool) -> None:
        """It registered over `channel`: it gets its route (and its pool of connections)."""
        self.state = "live"
        self.channel = channel
        self.answered_at = time.monotonic()
        remote = self.process if isinstance(self.process, PlacedHandle) else None
        address = self.socket_path if remote is None else remote.address
        self.route = WorkerRoute(
            self.owner, self.slot, address, keeps_rollout_prefix=keeps_rollout_prefix
        )
        self.route.pool = UpstreamPool(address, connect=None if remote is None else remote.connect)

    @property
    def node(self) -> str:
        """The Ray node it runs on; "" for a process of this machine."""
        return self.process.node_id if isinstance(self.process, PlacedHandle) else ""

    def memory(self) -> int:
        """Its resident bytes: read here for a process of this machine, as it reported
        them for one Ray placed (0 while not known)."""
        return resident_bytes(self.pid) if self.local else self.reported_memory

    @property
    def local(self) -> bool:
        """A process of this machine (its pid is one here: /proc, signals)."""
        return not isinstance(self.process, PlacedHandle)

    @property
    def live_route(self) -> WorkerRoute:
        """Its route in the router, which it has from its registration on."""
        if self.route is None:
            raise RuntimeError(f"worker {self.slot} (pid {self.pid}) has not registered")
        return self.route

    @property
    def live_channel(self) -> Channel:
        """Its channel to the coordinator, which it has from its registration on."""
        if self.channel is None:
            raise RuntimeError(f"worker {self.slot} (pid {self.pid}) has not registered")
        return self.channel

    @property
    def status(self) -> WorkerStatus:
        """The first that holds: booting (not registered yet), stopped, leaving (an
        operation stops it once it is empty), draining (it takes no new session),
        unresponsive (its pings go unanswered), else ready."""
        if self.state == "starting":
            return "booting"
        route = self.route
        if self.state == "dead" or route is None:
            return "stopped"
        if self.leaving:
            return "leaving"
        if route.draining:
            return "draining"
        return "ready" if route.responsive else "unresponsive"


def _quiet_future() -> asyncio.Future[None]:
    """A future whose exception nobody may ask for (a worker that exits before it
    registers, with no operation waiting on it) without asyncio complaining."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0
STABLE_AFTER = 10.0  # a worker that lived this long resets its slot's backoff


@dataclass
class Slot:
    worker: WorkerProcess | None = None
    successor: WorkerProcess | None = None  # a rolling restart's replacement, booting
    failures: int = 0
    restart_at: float = 0.0
    # For /metrics, over every incarnation of the slot: restarts after an exit, and
    # replacements by an operation; the answers and connect errors of workers gone.
    restarts: int = 0
    replacements: int = 0
    responses_gone: list[int] = field(default_factory=lambda: [0] * 6)
    connect_errors_gone: int = 0

    def count_gone(self, route: WorkerRoute) -> None:
        """Its worker's route is gone: its counts stay in the slot's."""
        for i, n in enumerate(route.responses):
            self.responses_gone[i] += n
        self.connect_errors_gone += route.pool.connect_errors

    def exited(self, lived: float, now: float) -> float:
        """Its worker exited after `lived` seconds, unasked: the delay before the slot is
        started again (exponential while its workers keep dying young)."""
        self.restarts += 1
        self.failures = 0 if lived >= STABLE_AFTER else self.failures + 1
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (self.failures - 1)) if self.failures else 0.0
        self.restart_at = now + delay
        return delay


async def terminate(workers: list[WorkerProcess], grace: float) -> None:
    """SIGTERM (SIGKILL when `grace` is 0), SIGKILL whatever still runs after `grace`
    seconds, and wait for every one."""
    running = [w for w in workers if w.process.returncode is None]
    for worker in running:
        with contextlib.suppress(ProcessLookupError):
            worker.process.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
    waits = [asyncio.ensure_future(w.process.wait()) for w in running]
    if not waits:
        return
    _, pending = await asyncio.wait(waits, timeout=grace or None)
    if pending:
        for worker in running:
            if worker.process.returncode is None:
                log.warning("worker %d did not stop in time; killing it", worker.slot)
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
        await asyncio.wait(waits)
