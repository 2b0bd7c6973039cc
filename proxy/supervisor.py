"""The one owner of worker lifecycle: spawn, register, ping, reap, restart, stop.

Each slot holds at most one `WorkerProcess` record. `reconcile()` compares the wanted
slots with the records and spawns what is missing (respecting each slot's backoff); it is
called after every event. A worker that exits with BOOT_ERROR cannot build the app, so
the supervisor stops the whole server instead of respawning it forever.

Liveness, as gunicorn and uvicorn do it: every live worker is pinged over its channel
(the worker's channel reader answers, so a pong means its event loop runs). A worker
silent for two ping intervals gets no new sessions; one silent for `--worker-timeout`
is killed (SIGKILL, which also ends a SIGSTOPped process) and restarted, and its
sessions answer 410.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from coordinator.checkpointer import LiveWorker
from coordinator.contract.channel import Channel
from coordinator.contract.exit_codes import BOOT_ERROR
from coordinator.contract.messages import Ping, Register
from coordinator.worker_channels import RegistrationRefused
from proxy.config import Config
from proxy.exchange import start_held
from proxy.routing import Router, WorkerRoute
from proxy.session_tokens import new_owner_id
from proxy.upstream import UpstreamPool
from worker.options import worker_argv

__all__ = ["WorkerProcess", "Supervisor", "WorkerBootError"]

log = logging.getLogger("gym_proxy.supervisor")

BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0
STABLE_AFTER = 10.0  # a worker that lived this long resets its slot's backoff
PING_INTERVAL = 1.0
# Owner IDs handed out before random ones, in order (tests choose owners with it).
TEST_OWNERS_ENV = "GYM_PROXY_TEST_OWNERS"


# starting -> live (registered) -> dead (exited, lost or killed)
WorkerState = Literal["starting", "live", "dead"]


class WorkerBootError(Exception):
    """A worker could not build the app; the server must stop."""


@dataclass(eq=False)
class WorkerProcess:
    """One worker incarnation."""

    slot: int
    owner: str
    socket_path: str
    process: asyncio.subprocess.Process
    started_at: float
    state: WorkerState = "starting"
    channel: Channel | None = None
    route: WorkerRoute | None = None
    answered_at: float = 0.0  # monotonic time of the last pong (or of registering)
    ping: asyncio.Future[Any] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class _Slot:
    worker: WorkerProcess | None = None
    failures: int = 0
    restart_at: float = 0.0


@dataclass(eq=False)
class Supervisor:
    config: Config
    runtime_dir: str
    coordinator_socket: str
    router: Router
    slots: list[_Slot] = field(default_factory=list)
    stopping: bool = False
    fatal: asyncio.Future[None] | None = None
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _registered: asyncio.Event = field(default_factory=asyncio.Event)
    _timer: asyncio.TimerHandle | None = None
    _warned_restart_only: bool = False
    # `python -P`: the current directory never shadows gym-proxy's packages. Tests of the
    # supervisor start stand-in workers instead.
    worker_command: tuple[str, ...] = (sys.executable, "-P", "-m", "worker")
    _owners: list[str] = field(
        default_factory=lambda: list(filter(None, os.environ.get(TEST_OWNERS_ENV, "").split(",")))
    )

    def __post_init__(self) -> None:
        self.slots = [_Slot() for _ in range(self.config.workers)]
        self.fatal = asyncio.get_running_loop().create_future()

    # ---- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """Spawn every slot and wait until all have registered (or one cannot boot)."""
        self.reconcile()
        waiter = asyncio.ensure_future(self._registered.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, self.fatal},
                timeout=self.config.boot_timeout or None,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            waiter.cancel()
        if self.fatal.done():
            self.fatal.result()
        if not done:
            raise WorkerBootError(f"workers did not register within {self.config.boot_timeout:g} s")

    def reconcile(self) -> None:
        """Spawn every slot that has no worker and whose backoff has passed."""
        if self.stopping:
            return
        now = time.monotonic()
        next_due: float | None = None
        for slot_index, slot in enumerate(self.slots):
            if slot.worker is not None:
                continue
            if slot.restart_at > now:
                next_due = min(next_due or slot.restart_at, slot.restart_at)
                continue
            self._track(self._spawn(slot_index))
        if next_due is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, next_due - now), self.reconcile
            )

    async def _spawn(self, slot_index: int) -> None:
        slot = self.slots[slot_index]
        owner = self._owners.pop(0) if self._owners else new_owner_id()
        socket_path = os.path.join(self.runtime_dir, f"w{slot_index}-{owner}.sock")
        # Reserve the slot before the first await so reconcile never spawns it twice.
        slot.worker = placeholder = WorkerProcess(slot_index, owner, socket_path, None, 0.0)  # type: ignore[arg-type]
        try:
            process = await asyncio.create_subprocess_exec(
                *self.worker_command,
                *worker_argv(
                    self.config,
                    slot=slot_index,
                    owner=owner,
                    socket=socket_path,
                    coordinator=self.coordinator_socket,
                ),
                stdin=asyncio.subprocess.DEVNULL,
            )
        except OSError as exc:
            slot.worker = None
            self._fail(WorkerBootError(f"cannot start a worker process: {exc}"))
            return
        placeholder.process = process
        if self.stopping:  # stop() began while this process started: it never serves
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            slot.worker = None
            return
        placeholder.started_at = time.monotonic()
        log.info("worker %d started (pid %d, owner %s)", slot_index, process.pid, owner)
        self._track(self._watch(placeholder))

    async def _watch(self, worker: WorkerProcess) -> None:
        code = await worker.process.wait()
        self._retire(worker)
        slot = self.slots[worker.slot]
        if slot.worker is worker:
            slot.worker = None
        if self.stopping:
            return
        if code == BOOT_ERROR:
            self._fail(
                WorkerBootError(
                    f"worker {worker.slot} cannot build app {self.config.app} (see above)"
                )
            )
            return
        lived = time.monotonic() - worker.started_at
        slot.failures = 0 if lived >= STABLE_AFTER else slot.failures + 1
        delay = 0.0
        if slot.failures:
            delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (slot.failures - 1))
        slot.restart_at = time.monotonic() + delay
        log.warning(
            "worker %d (pid %d, owner %s) exited with code %s; restarting in %.1f s",
            worker.slot,
            worker.pid,
            worker.owner,
            code,
            delay,
        )
        self.reconcile()

    # ---- coordinator callbacks ------------------------------------------------------
    def on_register(self, registration: Register, channel: Channel) -> None:
        """Accept a worker's `register` if it is the incarnation the slot expects."""
        slot_index = registration.slot
        if self.stopping:
            raise RegistrationRefused("gym-proxy is stopping")
        if not 0 <= slot_index < len(self.slots):
            raise RegistrationRefused(f"no slot {slot_index!r}")
        worker = self.slots[slot_index].worker
        if worker is None or worker.owner != registration.owner or worker.state != "starting":
            raise RegistrationRefused(
                f"slot {slot_index} does not expect owner {registration.owner!r}"
            )
        worker.state = "live"
        worker.channel = channel
        worker.answered_at = time.monotonic()
        worker.route = WorkerRoute(
            worker.owner,
            slot_index,
            worker.socket_path,
            keeps_rollout_prefix=registration.framework == "asgi",
        )
        worker.route.pool = UpstreamPool(worker.socket_path)
        if registration.app_cookie is not None:
            self.router.app_cookie = registration.app_cookie.encode("latin-1")
        if registration.restart_only and not self._warned_restart_only:
            self._warned_restart_only = True
            log.warning(
                "%s declares no session state, so it is a restart-only participant: a "
                "checkpoint exports none of its sessions and names the rollouts using them "
                "as restarts (declare a session dict, hooks or the session store to export "
                "them: README, 'State without code')",
                self.config.app,
            )
        self.router.add_worker(worker.route)
        log.info("worker %d registered (owner %s)", slot_index, worker.owner)
        if all(s.worker is not None and s.worker.state == "live" for s in self.slots):
            self._registered.set()

    def on_lost(self, owner: str) -> None:
        """A worker's channel ended: stop routing to it at once (its sessions get 410)."""
        for slot in self.slots:
            if slot.worker is not None and slot.worker.owner == owner:
                self._retire(slot.worker)

    # ---- liveness ------------------------------------------------------------------
    async def watch_liveness(self) -> None:
        """Ping every live worker; stop placing on silent ones, kill the ones that stay so."""
        timeout = self.config.worker_timeout
        interval = min(PING_INTERVAL, timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for worker in self.workers():
                if worker.state != "live" or worker.channel is None or worker.route is None:
                    continue
                if worker.ping is None or worker.ping.done():
                    worker.ping = asyncio.ensure_future(self._ping(worker, timeout))
                silent = now - worker.answered_at
                if silent > timeout:
                    log.error(
                        "worker %d (pid %d) did not answer for %.1f s; killing it",
                        worker.slot,
                        worker.pid,
                        silent,
                    )
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.kill()
                    self._retire(worker)
                elif silent > 2 * interval and worker.route.responsive:
                    log.warning("worker %d is not answering; no new sessions go to it", worker.slot)
                    worker.route.responsive = False

    async def _ping(self, worker: WorkerProcess, within: float) -> None:
        assert worker.channel is not None
        try:
            await worker.channel.request(Ping(), within=within)
        except (ConnectionError, TimeoutError):
            return  # a lost channel retires the worker; silence is judged by the watcher
        worker.answered_at = time.monotonic()
        if worker.route is not None and not worker.route.responsive:
            log.info("worker %d answers again", worker.slot)
            worker.route.responsive = True

    def _retire(self, worker: WorkerProcess) -> None:
        if worker.state == "dead":
            return
        worker.state = "dead"
        if worker.route is not None:
            self.router.remove_worker(worker.owner)
            worker.route.pool.close()
        if worker.channel is not None:
            worker.channel.close()
        if worker.ping is not None:
            worker.ping.cancel()

    # ---- the coordinator's view (coordinator.checkpointer.WorkerView) ----------------
    @property
    def expected(self) -> int:
        return self.config.workers

    def live(self) -> list[LiveWorker]:
        """Registered workers whose channel is up, by slot."""
        return [
            LiveWorker(w.slot, w.owner, w.pid, w.channel, w.route.in_flight)
            for w in self.workers()
            if w.state == "live" and w.channel is not None and w.route is not None
        ]

    def aliases(self) -> dict[str, str]:
        return dict(self.router.aliases)

    def placed_sessions(self) -> dict[str, str]:
        return dict(self.router.sessions)

    def set_tables(self, aliases: dict[str, str], sessions: dict[str, str]) -> None:
        self.router.set_tables(aliases, sessions)

    def sessions_ended(self, owner: str, session_ids: list[str]) -> None:
        self.router.forget_sessions(owner, session_ids)

    # ---- the mover's view (coordinator.mover.MoveTable) ---------------------------
    def hold_sessions(self, session_ids: list[str]) -> None:
        """New requests of these sessions wait at the proxy until released."""
        for session_id in session_ids:
            self.router.holding.setdefault(session_id, [])

    def release_sessions(self, session_ids: list[str]) -> None:
        """The held requests go on, routed by the tables as they are now."""
        start_held(self.router, session_ids)

    def running_requests(self, session_id: str) -> int:
        return self.router.active.get(session_id, 0)

    def place_session(self, session_id: str, owner: str) -> None:
        self.router.sessions[session_id] = owner

    # ---- stopping -----------------------------------------------------------------
    def workers(self) -> list[WorkerProcess]:
        """Current worker records, by slot."""
        return [slot.worker for slot in self.slots if slot.worker is not None]

    async def stop(self, grace: float) -> None:
        """SIGTERM every worker, SIGKILL those still running at the deadline, reap all."""
        self.stopping = True
        if self._timer is not None:
            self._timer.cancel()
        running = [
            w for w in self.workers() if w.process is not None and w.process.returncode is None
        ]
        for worker in running:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(w.process.wait()) for w in running]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=grace)
            if pending:
                for worker in running:
                    if worker.process.returncode is None:
                        log.warning("worker %d did not stop in time; killing it", worker.slot)
                        with contextlib.suppress(ProcessLookupError):
                            worker.process.kill()
                await asyncio.wait(waits)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _fail(self, exc: Exception) -> None:
        if self.fatal is not None and not self.fatal.done():
            self.fatal.set_exception(exc)

    def _track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
