"""The one owner of worker life cycle: spawn, register, ping, reap, restart, stop.

Each slot holds at most one `WorkerProcess` record. `reconcile()` compares the wanted
slots with the records and spawns what is missing (respecting each slot's backoff); it is
called after every event. A worker that exits with BOOT_ERROR cannot build the app, so
the supervisor stops the whole server instead of respawning it forever.

A worker that stops answering its pings (`proxy.fleet.supervision.liveness`) is killed
and restarted.

Live operations (`proxy.fleet.operations.live`) change the workers while they serve: a slot
may hold a *successor* beside its worker (a rolling restart starts it, waits until it
registers, moves the sessions over, then promotes it), slots are added and removed at
the end (resize), and a worker an operation stops is *leaving*: its exit is expected and
nothing restarts it. A worker an operation starts is on trial until it registers: if it
cannot boot, only that operation fails, never the server. What a predecessor's workers
need when they rejoin is `proxy.fleet.supervision.adoption`'s; when this gym-proxy passes
its workers on to a successor (`--take-over`), `pass_on` stops restarting them and `stop`
leaves them running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from gym_proxy.coordinator.checkpointer import LiveWorker
from gym_proxy.coordinator.contract.channel import Channel
from gym_proxy.coordinator.contract.exit_codes import BOOT_ERROR
from gym_proxy.coordinator.contract.messages import Register
from gym_proxy.coordinator.worker_channels import RegistrationRefused
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.data_path.routing import Router
from gym_proxy.proxy.data_path.session_tokens import new_owner_id
from gym_proxy.proxy.fleet.supervision.adoption import Adoption
from gym_proxy.proxy.fleet.supervision.intent import KeptIntent
from gym_proxy.proxy.fleet.supervision.launchers import WorkerLauncher
from gym_proxy.proxy.fleet.supervision.slots import Slots
from gym_proxy.proxy.fleet.supervision.worker_records import Slot, WorkerProcess, terminate
from gym_proxy.worker.options import worker_argv

__all__ = ["WorkerProcess", "Supervisor", "WorkerBootError", "Slot"]

log = logging.getLogger("gym_proxy.supervisor")

# Owner IDs handed out before random ones, in order (tests choose owners with it).
TEST_OWNERS_ENV = "GYM_PROXY_TEST_OWNERS"


class WorkerBootError(Exception):
    """A worker could not build the app; the server must stop."""


@dataclass(eq=False)
class Supervisor:
    config: Config
    runtime_dir: str
    coordinator_socket: str
    router: Router
    # What an operator asked, kept for a successor (the router was made with its
    # `aliases_changed`).
    intent: KeptIntent
    # Starts the workers (a subprocess each, the zygote's forks, Ray's actors: the server
    # chose, opens and closes it, `proxy.launch`).
    launcher: WorkerLauncher
    slots: Slots = field(init=False)
    stopping: bool = False
    fatal: asyncio.Future[None] = field(init=False)  # set when a worker cannot boot
    # Set while a predecessor's workers may rejoin (`proxy.fleet.supervision.adoption`).
    adoption: Adoption | None = None
    orphans_refused: str | None = None  # why a predecessor's workers are not adopted
    passing_on: bool = False  # a successor takes the workers (`pass_on`)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _registered: asyncio.Event = field(default_factory=asyncio.Event)
    _timer: asyncio.TimerHandle | None = None
    _stop_began: float = 0.0  # monotonic time stop() sent SIGTERM
    _owners: list[str] = field(
        default_factory=lambda: list(filter(None, os.environ.get(TEST_OWNERS_ENV, "").split(",")))
    )

    def __post_init__(self) -> None:
        self.slots = Slots(self.config.workers)
        self.fatal = asyncio.get_running_loop().create_future()

    def adopt(self, orphans: int, passed_on: bool) -> None:
        """`orphans` workers of a predecessor (a dead one's, or passed on) listen in the
        runtime directory: they are adopted as they rejoin, while `start` waits for them."""
        self.adoption = Adoption(self, orphans, passed_on)
        self.adoption.take_intent()

    # ---- life cycle ---------------------------------------------------------------
    async def start(self) -> None:
        """Adopt a predecessor's workers (when it left any), spawn every slot still
        empty and wait until all have registered (or one cannot boot)."""
        if self.adoption is not None:
            await self.adoption.window()
        self.reconcile()
        waiter = asyncio.ensure_future(self._registered.wait())
        either: set[asyncio.Future[Any]] = {waiter, self.fatal}
        # A placed worker may first wait for the cluster to grow (--placement-wait).
        boot = self.config.boot_timeout
        timeout = boot + self.config.room_wait if boot else None
        try:
            done, _ = await asyncio.wait(
                either, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiter.cancel()
        if self.fatal.done():
            self.fatal.result()
        if not done:
            raise WorkerBootError(f"workers did not register within {timeout:g} s")

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
            self.track(self._spawn(slot_index))
        if next_due is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, next_due - now), self.reconcile
            )

    async def _spawn(
        self, slot_index: int, successor: bool = False, awaited: bool = False
    ) -> WorkerProcess | None:
        """Start a worker process for the slot: its worker, or (`successor`) the one an
        operation will put in its place. None when no process could start; `awaited`
        (an operation waits for it): WorkerBootError saying why, raised."""
        owner = self._owners.pop(0) if self._owners else new_owner_id()
        socket_path = os.path.join(self.runtime_dir, f"w{slot_index}-{owner}.sock")
        # Reserved before the first await, so that reconcile never spawns it twice.
        placeholder = self.slots.reserve(slot_index, owner, socket_path, successor)
        argv = worker_argv(
            self.config,
            slot=slot_index,
            owner=owner,
            socket=socket_path,
            coordinator=self.coordinator_socket,
            instance=self.config.instance,
            workers=len(self.slots),
        )
        try:
            process = await self.launcher.spawn(argv)
        except OSError as exc:
            self.slots.vacate(placeholder)
            error = WorkerBootError(f"cannot start a worker process: {exc}")
            if awaited:
                raise error from None
            if placeholder.on_trial:
                placeholder.registered.set_exception(error)
            else:
                self._fail(error)
            return None
        placeholder.process = process
        if self.stopping:  # stop() began while this process started: it never serves
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            self.slots.vacate(placeholder)
            return None
        placeholder.started_at, placeholder.started_unix = time.monotonic(), time.time()
        kind = " (replacement)" if successor else ""
        log.info("worker %d%s started (pid %d, owner %s)", slot_index, kind, process.pid, owner)
        self.watch(placeholder)
        return placeholder

    def watch(self, worker: WorkerProcess) -> None:
        """Reap `worker` when it exits, and restart its slot when that was not asked for."""
        self.track(self._reap(worker))

    async def _reap(self, worker: WorkerProcess) -> None:
        code = await worker.process.wait()
        self._mark_dead(worker)
        if not worker.registered.done():
            why = f"worker {worker.slot} exited with code {code} before registering"
            worker.registered.set_exception(WorkerBootError(why))
        self.slots.left(worker)
        if worker.leaving:
            log.info("worker %d (pid %d) stopped with code %s", worker.slot, worker.pid, code)
            return
        replaced_slot = self.slots[worker.slot] if worker.slot < len(self.slots) else None
        current = replaced_slot is not None and replaced_slot.worker is worker
        self.slots.vacate(worker)
        if self.stopping:
            after = time.monotonic() - self._stop_began
            log.info(
                "worker %d (pid %d) exited with code %s, %.2f s after SIGTERM",
                *(worker.slot, worker.pid, code, after),
            )
            return
        if not current:  # a successor that died before its promotion: its operation says so
            log.warning("replacement worker %d exited with code %s", worker.slot, code)
            return
        slot = replaced_slot
        assert slot is not None
        if code == BOOT_ERROR and not worker.on_trial:
            why = f"worker {worker.slot} cannot build app {self.config.app} (see above)"
            self._fail(WorkerBootError(why))
            return
        now = time.monotonic()
        delay = slot.exited(now - worker.started_at, now)
        log.warning(
            "worker %d (pid %d, owner %s) exited with code %s; restarting in %.1f s",
            worker.slot,
            worker.pid,
            worker.owner,
            code,
            delay,
        )
        self.reconcile()

    # ---- registration ---------------------------------------------------------------
    def on_register(self, registration: Register, channel: Channel) -> None:
        """Accept a worker's `register` if it is the incarnation the slot expects (or a
        predecessor's worker rejoining while this gym-proxy adopts them)."""
        slot_index = registration.slot
        if self.stopping:
            raise RegistrationRefused("gym-proxy is stopping")
        if registration.rejoining:
            if self.adoption is None:
                raise RegistrationRefused(
                    self.orphans_refused
                    or "gym-proxy adopts a dead instance's workers only while it starts"
                )
            worker = self.adoption.admit(registration)
        else:
            worker = self.slots.expected(registration)
        worker.go_live(channel, keeps_rollout_prefix=registration.framework == "asgi")
        if registration.app_cookie is not None:
            self.router.app_cookie = registration.app_cookie.encode("latin-1")
        self.router.add_worker(worker.live_route)
        if registration.rejoining and self.adoption is not None:
            self.adoption.routed(worker, registration.held)
        log.info("worker %d registered (owner %s)", slot_index, worker.owner)
        if not worker.registered.done():
            worker.registered.set_result(None)
        if self.slots.all_live():
            self._registered.set()

    def on_lost(self, owner: str) -> None:
        """A worker's channel ended: stop routing to it at once (its sessions get 410)."""
        if self.passing_on:
            return  # it goes to the successor; this one still routes its open connections
        for worker in self.slots.workers():
            if worker.owner == owner:
                self._mark_dead(worker)

    def kill(self, worker: WorkerProcess) -> None:
        """SIGKILL a worker that stopped answering (`proxy.fleet.supervision.liveness`); it is
        restarted as any worker that exits."""
        with contextlib.suppress(ProcessLookupError):
            worker.process.kill()
        self._mark_dead(worker)

    def _mark_dead(self, worker: WorkerProcess) -> None:
        if worker.state == "dead":
            return
        worker.state = "dead"
        if worker.route is not None:
            self.router.remove_worker(worker.owner)
            worker.route.pool.close()
            if worker.slot < len(self.slots):  # its counts stay in its slot's series
                self.slots[worker.slot].count_gone(worker.route)
        if worker.channel is not None:
            worker.channel.close()
        if worker.ping is not None:
            worker.ping.cancel()
        if worker.owner in self.intent.drained:  # a drained worker takes its drain with it
            self.intent.set_drained(worker.owner, False)

    # ---- the workers as others see them -------------------------------------------
    @property
    def expected(self) -> int:
        """How many workers the server has (the checkpointer's count)."""
        return len(self.slots)

    def live(self) -> list[LiveWorker]:
        """Registered workers whose channel is up, by slot (a successor or a leaving
        worker too: both serve sessions while an operation runs)."""
        return [
            LiveWorker(w.slot, w.owner, w.pid, w.channel, w.route.in_flight)
            for w in self.slots.workers()
            if w.state == "live" and w.channel is not None and w.route is not None
        ]

    # ---- for the live operations (proxy.fleet.operations.decommission.WorkerPool) -------------
    async def start_successor(self, slot_index: int, within: float) -> WorkerProcess:
        """Start a replacement for the slot's worker and wait until it registers (it
        takes new sessions from then on); WorkerBootError, after killing it, when it
        cannot boot in `within` seconds."""
        worker = await self._spawn(slot_index, successor=True, awaited=True)
        if worker is None:
            raise WorkerBootError(f"slot {slot_index}: the replacement did not start")
        return await self._registered_within(worker, within)

    async def add_slot(self, within: float) -> WorkerProcess:
        """Grow by one slot at the end and wait until its worker registers; on failure
        the slot is removed again (WorkerBootError)."""
        slot_index = len(self.slots)
        self.slots.grow_to(slot_index + 1)
        self.resized()
        self.slots.trial += 1
        worker: WorkerProcess | None = None
        try:
            try:
                worker = await self._spawn(slot_index, awaited=True)
            finally:
                self.slots.trial -= 1
            if worker is None:
                raise WorkerBootError(f"slot {slot_index}: the worker did not start")
            worker = await self._registered_within(worker, within)
        except BaseException as exc:
            if slot_index == len(self.slots) - 1:
                self.slots.remove_last()
                self.resized()
            if isinstance(exc, asyncio.CancelledError) and worker is not None:
                # Cancelled as it booted (an autoscale grow that gave way): it never serves.
                await self.stop_worker(worker, 0.0)
            raise
        worker.on_trial = False
        return worker

    async def _registered_within(self, worker: WorkerProcess, within: float) -> WorkerProcess:
        try:
            await asyncio.wait_for(asyncio.shield(worker.registered), within)
        except TimeoutError:
            await self.stop_worker(worker, 0.0)
            raise WorkerBootError(
                f"slot {worker.slot}: the new worker did not register within {within:g} s"
            ) from None
        except WorkerBootError:
            self.slots.vacate(worker)
            raise
        return worker

    def remove_last_slot(self) -> WorkerProcess | None:
        """Shrink by the last slot; its worker (returned, leaving) is the caller's to stop."""
        worker = self.slots.remove_last()
        self.resized()
        return worker

    def take_out_of_service(self, worker: WorkerProcess) -> None:
        """No request reaches it any more (a leaving worker, emptied)."""
        self._mark_dead(worker)

    async def stop_worker(self, worker: WorkerProcess, grace: float) -> int | None:
        """SIGTERM a worker an operation is done with (SIGKILL after `grace`); its exit
        is expected. Answers its exit code."""
        self.slots.leave(worker)
        if worker.process is None:  # a placeholder whose process is still starting
            return None
        await terminate([worker], grace)
        self._mark_dead(worker)
        self.slots.vacate(worker)
        return worker.process.returncode

    def resized(self) -> None:
        """The slot count changed (workers started from now on are told it, as the slots
        have it): a successor finds it in the intent."""
        self.intent.resized(len(self.slots))

    # ---- stopping -----------------------------------------------------------------
    async def stop(self, grace: float) -> None:
        """SIGTERM every worker, SIGKILL those still running at the deadline, reap all;
        after `pass_on`, only let them go."""
        if self.passing_on:  # the workers go on serving the successor: only stop watching
            await self._untrack_all()
            return
        self.stopping = True
        if self._timer is not None:
            self._timer.cancel()
        running = [
            w
            for w in self.slots.workers()
            if w.process is not None and w.process.returncode is None
        ]
        if running:
            log.info(
                "stopping %d worker%s: SIGTERM sent; each finishes its requests and its "
                "app's shutdown, SIGKILL for any still running in %g s",
                len(running),
                "" if len(running) == 1 else "s",
                grace,
            )
        self._stop_began = time.monotonic()
        await terminate(running, grace)
        await self._untrack_all()

    def pass_on(self) -> None:
        """A successor takes the workers (`--take-over`): start, restart and stop none,
        and keep routing the requests still coming on this one's open connections."""
        self.stopping = True
        self.passing_on = True
        if self._timer is not None:
            self._timer.cancel()

    async def _untrack_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _fail(self, exc: Exception) -> None:
        if not self.fatal.done():
            self.fatal.set_exception(exc)

    def track(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` as a task the supervisor cancels when it stops."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
