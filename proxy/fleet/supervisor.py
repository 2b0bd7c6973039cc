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

Live operations (`proxy.fleet.operations`) change the workers while they serve: a slot
may hold a *successor* beside its worker (a rolling restart starts it, waits until it
registers, moves the sessions over, then promotes it), slots are added and removed at
the end (resize), and a worker an operation stops is *leaving*: its exit is expected and
nothing restarts it. A worker an operation starts is on trial until it registers: if it
cannot boot, only that operation fails, never the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gym_proxy.coordinator.checkpointer import LiveWorker
from gym_proxy.coordinator.contract import failpoints
from gym_proxy.coordinator.contract.channel import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    RemoteError,
)
from gym_proxy.coordinator.contract.exit_codes import BOOT_ERROR
from gym_proxy.coordinator.contract.messages import Drop, Ping, Register
from gym_proxy.coordinator.placement import Placement
from gym_proxy.coordinator.worker_channels import RegistrationRefused
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.data_path.exchange import start_held, start_held_by_worker
from gym_proxy.proxy.data_path.routing import ExpectedHandover, Router, WorkerRoute
from gym_proxy.proxy.data_path.session_tokens import new_owner_id
from gym_proxy.proxy.data_path.upstream import UpstreamPool
from gym_proxy.proxy.fleet.adopted_copies import AdoptedCopies
from gym_proxy.proxy.fleet.intent import FleetIntent, load_intent, save_intent
from gym_proxy.proxy.fleet.mover import DROP_WAIT
from gym_proxy.proxy.fleet.session_watch import until_a_request_ends
from gym_proxy.proxy.fleet.worker_records import (
    AdoptedProcess,
    Slot,
    WorkerHandle,
    WorkerLauncher,
    WorkerProcess,
    resident_bytes,
)
from gym_proxy.proxy.fleet.zygote_client import Zygote
from gym_proxy.worker.options import worker_argv

__all__ = ["WorkerProcess", "Supervisor", "WorkerBootError", "Slot"]

log = logging.getLogger("gym_proxy.supervisor")

BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0
STABLE_AFTER = 10.0  # a worker that lived this long resets its slot's backoff
PING_INTERVAL = 1.0
# How long a gym-proxy that took over a dead instance's runtime directory waits for its
# workers to rejoin (they look every 0.1 s) before it starts the slots still empty.
ADOPT_WINDOW = 5.0
MAX_GROWTH = 64  # slots an adoption may add past those it found listening
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
    slots: list[Slot] = field(default_factory=list)
    stopping: bool = False
    fatal: asyncio.Future[None] = field(init=False)  # set when a worker cannot boot
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _registered: asyncio.Event = field(default_factory=asyncio.Event)
    _timer: asyncio.TimerHandle | None = None
    _warned_restart_only: bool = False
    _warned_ceiling: bool = False
    _leaving: set[WorkerProcess] = field(default_factory=set)
    _trial_slots: int = 0  # slots an operation is adding: their boot errors are not fatal
    # Set when a dead instance's runtime directory was taken over: its workers may be
    # waiting to rejoin (`--orphan-grace`); until the adoption window ends they are
    # adopted into their slots, and only then are the empty slots started.
    adopting: bool = False
    orphans: int = 0  # the dead instance's workers still listening when this one started
    handing_over: bool = False  # a new gym-proxy is taking the workers (`hand_over`)
    drained: set[str] = field(default_factory=set)  # owners an operator drained (`intent`)
    _all_adopted: asyncio.Event = field(default_factory=asyncio.Event)
    _copies: AdoptedCopies = field(default_factory=AdoptedCopies)
    _stop_began: float = 0.0  # monotonic time stop() sent SIGTERM
    # What a worker asks of its operator: recycle(slot, reason) (live operations set it).
    on_recycle: Any = None
    on_held: Any = None  # called with how long released held requests waited (/metrics)
    # `python -P`: the current directory never shadows gym-proxy's packages. Tests of the
    # supervisor start stand-in workers instead.
    worker_command: tuple[str, ...] = (sys.executable, "-P", "-m", "gym_proxy.worker")
    # Starts workers instead of a subprocess: the zygote with --preload (workers are
    # forked from it), or a test's in-process launcher.
    launcher: WorkerLauncher | None = None
    _owners: list[str] = field(
        default_factory=lambda: list(filter(None, os.environ.get(TEST_OWNERS_ENV, "").split(",")))
    )

    def __post_init__(self) -> None:
        self.slots = [Slot() for _ in range(self.config.workers)]
        self.fatal = asyncio.get_running_loop().create_future()
        if self.config.preload and self.launcher is None:
            config = self.config
            self.launcher = Zygote(
                config.app, config.app_dir, config.limit_request_line, config.limit_request_headers
            )

    # ---- what the operator asked (proxy.fleet.intent) -------------------------------
    def take_intent(self) -> None:
        """Adopting: keep the worker count and the drains the dead instance left."""
        intent = load_intent(self.runtime_dir)
        if intent is None:
            return
        if intent.workers != len(self.slots):
            log.warning(
                "keeping the %d workers the dead instance was resized to (--workers %d; "
                "resize to change that)",
                intent.workers,
                len(self.slots),
            )
            self.slots = [Slot() for _ in range(intent.workers)]
            self._resized()
        self.drained = set(intent.drained)
        self.router.aliases = dict(intent.aliases)

    def set_drained(self, worker: WorkerProcess, drained: bool) -> None:
        """An operator's drain (or undrain) of `worker`: kept for an adopting successor."""
        worker.live_route.draining = drained
        (self.drained.add if drained else self.drained.discard)(worker.owner)
        self._keep_intent()

    def _keep_intent(self) -> None:
        if not self.adopting:  # a drained worker that died took its drain with it
            self.drained &= {w.owner for w in self.workers()}
        try:
            intent = FleetIntent(len(self.slots), frozenset(self.drained), self.router.aliases)
            save_intent(self.runtime_dir, intent)
        except OSError as exc:  # the directory went away: the server goes on without it
            log.warning("could not keep the fleet's intent in %s: %s", self.runtime_dir, exc)

    # ---- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """Adopt a dead instance's workers (when it left any), spawn every slot still
        empty and wait until all have registered (or one cannot boot)."""
        if self.adopting:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_adopted.wait(), ADOPT_WINDOW)
            self.adopting = False
            self._copies.clear()
            adopted = [s.worker for s in self.slots if s.worker is not None]
            log.info(
                "adopted %d worker%s of the %s instance (pids %s)",
                len(adopted),
                "" if len(adopted) == 1 else "s",
                "handing-over" if self.config.take_over else "dead",
                ", ".join(str(w.pid) for w in adopted) or "none",
            )
        self.reconcile()
        waiter = asyncio.ensure_future(self._registered.wait())
        either: set[asyncio.Future[Any]] = {waiter, self.fatal}
        try:
            done, _ = await asyncio.wait(
                either,
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

    async def _spawn(self, slot_index: int, successor: bool = False) -> WorkerProcess | None:
        """Start a worker process for the slot: its worker, or (`successor`) the one an
        operation will put in its place. None when no process could start."""
        slot = self.slots[slot_index]
        owner = self._owners.pop(0) if self._owners else new_owner_id()
        socket_path = os.path.join(self.runtime_dir, f"w{slot_index}-{owner}.sock")
        # Reserve the slot before the first await so reconcile never spawns it twice.
        placeholder = WorkerProcess(slot_index, owner, socket_path, None, 0.0)  # type: ignore[arg-type]
        placeholder.on_trial = successor or self._trial_slots > 0
        limit = self.config.max_requests
        if limit:
            placeholder.max_requests = limit + random.randint(0, self.config.max_requests_jitter)
        if successor:
            slot.successor = placeholder
        else:
            slot.worker = placeholder
        argv = worker_argv(
            self.config,
            slot=slot_index,
            owner=owner,
            socket=socket_path,
            coordinator=self.coordinator_socket,
            instance=self.config.instance,
        )
        process: WorkerHandle
        try:
            if self.launcher is not None:
                process = await self.launcher.spawn(argv)
            else:
                process = await asyncio.create_subprocess_exec(
                    *self.worker_command, *argv, stdin=asyncio.subprocess.DEVNULL
                )
        except OSError as exc:
            self._vacate(placeholder)
            error = WorkerBootError(f"cannot start a worker process: {exc}")
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
            self._vacate(placeholder)
            return None
        placeholder.started_at = time.monotonic()
        placeholder.started_unix = time.time()
        log.info(
            "worker %d%s started (pid %d, owner %s)",
            slot_index,
            " (replacement)" if successor else "",
            process.pid,
            owner,
        )
        self._track(self._watch(placeholder))
        return placeholder

    def _vacate(self, worker: WorkerProcess) -> None:
        """The slot no longer holds `worker` (as its worker or successor)."""
        if worker.slot >= len(self.slots):
            return
        slot = self.slots[worker.slot]
        if slot.worker is worker:
            slot.worker = None
        if slot.successor is worker:
            slot.successor = None

    async def _watch(self, worker: WorkerProcess) -> None:
        code = await worker.process.wait()
        self._mark_dead(worker)
        if not worker.registered.done():
            worker.registered.set_exception(
                WorkerBootError(f"worker {worker.slot} exited with code {code} before registering")
            )
        self._leaving.discard(worker)
        if worker.leaving:
            log.info("worker %d (pid %d) stopped with code %s", worker.slot, worker.pid, code)
            return
        replaced_slot = self.slots[worker.slot] if worker.slot < len(self.slots) else None
        current = replaced_slot is not None and replaced_slot.worker is worker
        self._vacate(worker)
        if self.stopping:
            log.info(
                "worker %d (pid %d) exited with code %s, %.2f s after SIGTERM",
                worker.slot,
                worker.pid,
                code,
                time.monotonic() - self._stop_began,
            )
            return
        if not current:  # a successor that died before its promotion: its operation says so
            log.warning("replacement worker %d exited with code %s", worker.slot, code)
            return
        slot = replaced_slot
        assert slot is not None
        if code == BOOT_ERROR and not worker.on_trial:
            self._fail(
                WorkerBootError(
                    f"worker {worker.slot} cannot build app {self.config.app} (see above)"
                )
            )
            return
        lived = time.monotonic() - worker.started_at
        slot.restarts += 1
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
        if registration.rejoining and self.adopting:
            self._grow_for(slot_index)
        if not 0 <= slot_index < len(self.slots):
            raise RegistrationRefused(f"no slot {slot_index!r}")
        slot = self.slots[slot_index]
        worker: WorkerProcess | None
        if registration.rejoining:
            worker = self._adopt(registration)
        else:
            worker = next(
                (
                    w
                    for w in (slot.worker, slot.successor)
                    if w is not None and w.owner == registration.owner and w.state == "starting"
                ),
                None,
            )
        if worker is None:
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
                "them: docs/nemo_gym.md, 'State without code')",
                self.config.app,
            )
        self.router.add_worker(worker.route)
        if registration.rejoining:
            worker.route.draining = worker.owner in self.drained
            self._place_held(worker, registration.held)
        log.info("worker %d registered (owner %s)", slot_index, worker.owner)
        if not worker.registered.done():
            worker.registered.set_result(None)
        if all(s.worker is not None and s.worker.state == "live" for s in self.slots):
            self._registered.set()

    def _place_held(self, worker: WorkerProcess, held: dict[str, float]) -> None:
        """A rejoining worker's sessions route to it whatever owner their tokens name (a
        restore or a move put some there): the dead instance's tables are not kept. A
        session another adopted worker holds too stays with the one that used it last
        (`adopted_copies`); the other copy is dropped."""
        routed, stale = self._copies.take(worker.owner, held)
        kept = self.router.kept
        for session_id in routed:
            kept[session_id] = worker.owner
        by_owner = {w.owner: w for w in self.workers()}
        for owner, session_ids in stale.items():
            loser = by_owner.get(owner)
            log.warning(
                "%d sessions were held by two workers (a move cut by the crash): worker %s "
                "drops its older copies (%s)",
                len(session_ids),
                "?" if loser is None else loser.slot,
                ", ".join(session_ids[:3]) + (" ..." if len(session_ids) > 3 else ""),
            )
            if loser is not None:
                self._track(self._drop_copies(loser, session_ids))

    async def _drop_copies(self, worker: WorkerProcess, session_ids: list[str]) -> None:
        try:
            await worker.live_channel.request(Drop(session_ids, []), within=DROP_WAIT)
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            log.warning("worker %d did not drop its older copies: %s", worker.slot, exc)

    def _grow_for(self, slot_index: int) -> None:
        """A dead instance's worker in a slot past `--workers` (it had been resized up):
        adopted, not dropped with its sessions; the server keeps that many workers."""
        if not len(self.slots) <= slot_index < max(len(self.slots), self.orphans) + MAX_GROWTH:
            return
        log.warning(
            "adopting worker %d beyond --workers %d (the dead instance had been resized): "
            "the server now has %d workers (resize to change that)",
            slot_index,
            len(self.slots),
            slot_index + 1,
        )
        while len(self.slots) <= slot_index:
            self.slots.append(Slot())
        self._resized()

    def _adopt(self, registration: Register) -> WorkerProcess:
        """A dead instance's worker rejoins: it takes its slot, as it was."""
        slot_index = registration.slot
        if not self.adopting:
            raise RegistrationRefused(
                "gym-proxy adopts a dead instance's workers only while it starts"
            )
        slot = self.slots[slot_index]
        if slot.worker is not None:
            raise RegistrationRefused(f"slot {slot_index} has a worker already")
        try:
            process = AdoptedProcess(registration.pid)
        except OSError as exc:
            raise RegistrationRefused(f"pid {registration.pid}: {exc.strerror}") from None
        worker = WorkerProcess(
            slot_index, registration.owner, registration.socket, process, time.monotonic()
        )
        worker.started_unix = time.time()
        slot.worker = worker
        failpoints.hit("adopting")  # a crash with a worker half adopted (tests)
        log.info(
            "worker %d (pid %d, owner %s) adopted with %d sessions",
            slot_index,
            registration.pid,
            registration.owner,
            len(registration.held),
        )
        self._track(self._watch(worker))
        if sum(1 for s in self.slots if s.worker is not None) >= self.orphans:
            self._all_adopted.set()  # every worker found listening is back
        return worker

    def hand_over(self) -> None:
        """A new gym-proxy takes the workers (`--take-over`): start, restart and stop none,
        and keep routing the requests still coming on this one's open connections."""
        self.stopping = True
        self.handing_over = True
        if self._timer is not None:
            self._timer.cancel()

    async def let_go(self) -> None:
        """After a hand-over: stop watching the workers, leave them running."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.launcher is not None:
            await self.launcher.close()

    def on_lost(self, owner: str) -> None:
        """A worker's channel ended: stop routing to it at once (its sessions get 410)."""
        if self.handing_over:
            return  # it goes to the new proxy; this one still routes its open connections
        for worker in self.workers():
            if worker.owner == owner:
                self._mark_dead(worker)

    # ---- liveness ------------------------------------------------------------------
    async def watch_liveness(self) -> None:
        """Ping every live worker; stop placing on silent ones, kill the ones that stay so."""
        timeout = self.config.worker_timeout
        interval = min(PING_INTERVAL, timeout / 4)
        while True:  # pings first: the workers' first pings go out as soon as it starts
            now = time.monotonic()
            for worker in self.workers():
                if worker.state != "live" or worker.channel is None or worker.route is None:
                    continue
                if worker.ping is None:
                    # Silence counts from its first ping, not from its registering: it
                    # may have registered seconds before the last worker did (a busy
                    # machine) and had nothing to answer since.
                    worker.answered_at = now
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
                    self._mark_dead(worker)
                elif silent > 2 * interval and worker.route.responsive:
                    log.warning("worker %d is not answering; no new sessions go to it", worker.slot)
                    worker.route.responsive = False
            self._check_recycling()
            await asyncio.sleep(interval)

    def _check_recycling(self) -> None:
        """Ask for a recycle of each slot's worker past --max-requests or the memory
        ceiling (asked again every interval until it happens: a checkpoint may defer it)."""
        if self.on_recycle is None:
            return
        ceiling = self.config.max_worker_memory * 1024 * 1024
        for slot in self.slots:
            worker = slot.worker
            if worker is None or worker.state != "live" or worker.route is None:
                continue
            if worker.max_requests and worker.route.served >= worker.max_requests:
                self.on_recycle(worker.slot, f"served {worker.route.served} requests")
            elif ceiling and (rss := resident_bytes(worker.pid)) > ceiling:
                if time.monotonic() - worker.started_at >= STABLE_AFTER:
                    self.on_recycle(worker.slot, f"resident memory {rss / 2**20:.0f} MiB")
                elif not self._warned_ceiling:
                    # Its replacement would be over it too: a recycle a few seconds apart,
                    # for ever. It is still done (the ceiling is the operator's), but said.
                    self._warned_ceiling = True
                    log.warning(
                        "--max-worker-memory %g MiB is below a fresh worker's resident "
                        "memory (%.0f MiB): every worker will be recycled about every %g s",
                        self.config.max_worker_memory,
                        rss / 2**20,
                        STABLE_AFTER,
                    )

    async def _ping(self, worker: WorkerProcess, within: float) -> None:
        assert worker.channel is not None
        sent = time.monotonic()
        try:
            await worker.channel.request(Ping(), within=within)
        except (ConnectionError, TimeoutError):
            return  # a lost channel retires the worker; silence is judged by the watcher
        worker.answered_at = time.monotonic()
        worker.ping_seconds = worker.answered_at - sent
        if worker.route is not None and not worker.route.responsive:
            log.info("worker %d answers again", worker.slot)
            worker.route.responsive = True

    def _mark_dead(self, worker: WorkerProcess) -> None:
        if worker.state == "dead":
            return
        worker.state = "dead"
        if worker.route is not None:
            self.router.remove_worker(worker.owner)
            worker.route.pool.close()
            if worker.slot < len(self.slots):  # its counts stay in its slot's series
                slot = self.slots[worker.slot]
                for i, n in enumerate(worker.route.responses):
                    slot.responses_gone[i] += n
                slot.connect_errors_gone += worker.route.pool.connect_errors
        if worker.channel is not None:
            worker.channel.close()
        if worker.ping is not None:
            worker.ping.cancel()

    # ---- the coordinator's view (coordinator.checkpointer.WorkerView) ----------------
    @property
    def expected(self) -> int:
        return len(self.slots)

    def live(self) -> list[LiveWorker]:
        """Registered workers whose channel is up, by slot (a successor or a leaving
        worker too: both serve sessions while an operation runs)."""
        return [
            LiveWorker(w.slot, w.owner, w.pid, w.channel, w.route.in_flight)
            for w in self.workers()
            if w.state == "live" and w.channel is not None and w.route is not None
        ]

    def aliases(self) -> dict[str, str]:
        return dict(self.router.aliases)

    def placed_sessions(self) -> dict[str, str]:
        return dict(self.router.sessions)

    def placed_app_sessions(self) -> dict[str, str]:
        return dict(self.router.app_sessions)

    @property
    def keeps_app_sessions(self) -> bool:
        return self.router.app_cookie is not None

    def set_tables(self, placement: Placement) -> None:
        self.router.set_tables(placement.aliases, placement.sessions, placement.app_sessions)
        self._keep_intent()  # the aliases

    def sessions_ended(self, owner: str, session_ids: list[str]) -> None:
        self.router.forget_sessions(owner, session_ids)

    # ---- live operations (proxy.fleet.operations.WorkerPool) -----------------------
    def current(self, slot_index: int) -> WorkerProcess | None:
        """The live worker of the slot, if it has one."""
        if not 0 <= slot_index < len(self.slots):
            return None
        worker = self.slots[slot_index].worker
        return worker if worker is not None and worker.state == "live" else None

    async def start_successor(self, slot_index: int, within: float) -> WorkerProcess:
        """Start a replacement for the slot's worker and wait until it registers (it
        takes new sessions from then on); WorkerBootError, after killing it, when it
        cannot boot in `within` seconds."""
        worker = await self._spawn(slot_index, successor=True)
        if worker is None:
            raise WorkerBootError(f"slot {slot_index}: the replacement did not start")
        return await self._registered_within(worker, within)

    async def add_slot(self, within: float) -> WorkerProcess:
        """Grow by one slot at the end and wait until its worker registers; on failure
        the slot is removed again (WorkerBootError)."""
        self.slots.append(Slot())
        self._resized()
        slot_index = len(self.slots) - 1
        self._trial_slots += 1
        try:
            worker = await self._spawn(slot_index)
        finally:
            self._trial_slots -= 1
        try:
            if worker is None:
                raise WorkerBootError(f"slot {slot_index}: the worker did not start")
            worker = await self._registered_within(worker, within)
        except BaseException:
            if slot_index == len(self.slots) - 1:
                self.slots.pop()
                self._resized()
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
            self._vacate(worker)
            raise
        return worker

    def promote(self, successor: WorkerProcess) -> WorkerProcess | None:
        """The successor becomes its slot's worker; the worker it replaces is returned,
        out of the slot (the caller stops it)."""
        slot = self.slots[successor.slot]
        old, slot.worker, slot.successor = slot.worker, successor, None
        successor.on_trial = False
        slot.replacements += 1
        if old is not None:
            old.leaving = True
            self._leaving.add(old)
        return old

    def remove_last_slot(self) -> WorkerProcess | None:
        """Shrink by the last slot; its worker (returned, leaving) is the caller's to stop."""
        slot = self.slots.pop()
        self._resized()
        for worker in (slot.worker, slot.successor):
            if worker is not None:
                worker.leaving = True
                self._leaving.add(worker)
        return slot.worker

    def take_out_of_service(self, worker: WorkerProcess) -> None:
        """No request reaches it any more (a leaving worker, emptied)."""
        self._mark_dead(worker)

    async def stop_worker(self, worker: WorkerProcess, grace: float) -> int | None:
        """SIGTERM a worker an operation is done with (SIGKILL after `grace`); its exit
        is expected. Answers its exit code."""
        worker.leaving = True
        self._leaving.add(worker)
        process = worker.process
        if process is None:
            return None
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
            try:
                await asyncio.wait_for(asyncio.shield(process.wait()), grace or None)
            except TimeoutError:
                log.warning("worker %d did not stop in time; killing it", worker.slot)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        self._mark_dead(worker)
        self._vacate(worker)
        return process.returncode

    def hold_worker(self, worker: WorkerProcess) -> None:
        """Requests routed to it wait at the proxy from now on."""
        if worker.route is not None and worker.route.held is None:
            worker.route.held = []

    def release_worker(self, worker: WorkerProcess) -> None:
        """The requests held at it start again, routed by the tables as they are now."""
        if worker.route is not None:
            self._waited(start_held_by_worker(worker.route))

    def inherit_owner(self, old: str, heir: str) -> None:
        self.router.inherit_owner(old, heir)
        self._keep_intent()  # the aliases

    def _resized(self) -> None:
        # Workers started from now on are told the new count (a NeMo Gym class reads it).
        self.config = dataclasses.replace(self.config, workers=len(self.slots))
        self._keep_intent()

    # ---- the mover's view (proxy.fleet.mover.MoveTable) ---------------------------
    def hold_sessions(self, session_ids: list[str]) -> None:
        """New requests of these sessions wait at the proxy until released."""
        for session_id in session_ids:
            self.router.holding.setdefault(session_id, [])

    def release_sessions(self, session_ids: list[str]) -> None:
        """The held requests go on, routed by the tables as they are now."""
        self._waited(start_held(self.router, session_ids))

    def _waited(self, waits: list[float]) -> None:
        if waits and self.on_held is not None:
            self.on_held(waits)

    def running_requests(self, session_id: str) -> int:
        return self.router.active.get(session_id, 0)

    async def until_a_request_ends(self, session_ids: Iterable[str], deadline: float) -> None:
        await until_a_request_ends(self.router, session_ids, deadline)

    def place_session(self, session_id: str, owner: str, kept: bool) -> None:
        """`kept`: a session ID as the workers keep it (a record's); else a gym-proxy
        session that rides along with one (`proxy.data_path.routing`, "Identity")."""
        table = self.router.kept if kept else self.router.sessions
        table[session_id] = owner

    def expect_handover(self, handover_id: str, source: str, target: str) -> asyncio.Future[str]:
        arrived: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        routes = self.router.workers
        if source not in routes or target not in routes:
            arrived.set_result("the source or the target worker is gone")
        else:
            handover = ExpectedHandover(routes[source], routes[target], arrived)
            self.router.handovers[handover_id.encode()] = handover
        return arrived

    def forget_handover(self, handover_id: str) -> None:
        self.router.handovers.pop(handover_id.encode(), None)

    # ---- stopping -----------------------------------------------------------------
    def workers(self) -> list[WorkerProcess]:
        """Every worker record: each slot's worker and successor, then leaving ones."""
        records = [w for slot in self.slots for w in (slot.worker, slot.successor) if w is not None]
        return records + sorted(self._leaving - set(records), key=lambda w: w.slot)

    async def stop(self, grace: float) -> None:
        """SIGTERM every worker, SIGKILL those still running at the deadline, reap all."""
        self.stopping = True
        if self._timer is not None:
            self._timer.cancel()
        running = [
            w for w in self.workers() if w.process is not None and w.process.returncode is None
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
        if self.launcher is not None:
            await self.launcher.close()

    def _fail(self, exc: Exception) -> None:
        if self.fatal is not None and not self.fatal.done():
            self.fatal.set_exception(exc)

    def _track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
