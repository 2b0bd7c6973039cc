"""Live operations: drain, resize, rolling restart and recycle, built on session moves.

Each runs on the proxy's event loop while the server serves, excludes checkpoints and
every other operation (409 `operation_conflict`, both ways), reports its progress in
`status` while it runs, and answers what it did and what it could not.

- **drain** a slot: its worker takes no new sessions and its sessions move to the other
  workers (a restart-only app's sessions cannot move: they are waited for until they
  end, up to the timeout, then reported); its running `/run` episodes are handed over
  beside them, each at its next boundary (`proxy.fleet.moves.handovers`). The worker stays
  up, draining, until `undrain`.
- **decommission** a worker (the step a restart and a shrink share): drain it into its heirs,
  then hold every request still routed to it at the proxy, wait for its running
  requests to end (handing over the episodes among them), move what they left, send
  whatever still names its owner to an heir (`Router.inherit_owner`), start the held
  requests again, and stop it. A worker that cannot be emptied by the timeout (a session
  whose request runs on, an episode that reaches no boundary, a restart-only session
  that does not end) is not stopped: it keeps serving what it holds, taking nothing new,
  and is decommissioned in the background as soon as it can be; the answer names what it
  kept.
- **rolling restart**, one slot at a time: start the replacement (new code: a fresh
  `python -m gym_proxy.worker`; with `--preload`, a fork of the zygote, which imported
  the app once), wait until it registers, make it the slot's worker, decommission the old
  one into it. A replacement that does not boot aborts the restart: the old worker
  keeps serving and the slots not reached yet are left alone. Slots are RESTART_PAUSE
  seconds apart (`pause_s`): booting a worker costs its CPU (0.2 s here) and a fresh
  worker serves its first requests cold, so back to back on a loaded machine the
  boots take a slice of the serving; apart, they take a thinner one for longer.
- **resize** to M: grow starts workers in new slots at the end, one by one; shrink
  removes the last slots and decommissions their workers into the rest. The
  autoscaler's resize gives way (`coordinator.exclusion`): asked to, a grow stops the
  worker that boots and removes its slot again, and a shrink, which empties and takes out
  the last slot's worker before it removes the slot, lets that worker take new sessions
  again (`Decommissioner.take_out_or_keep`); either keeps the worker count it had, and
  answers `gave_way`.
- **recycle**: its policy (`proxy.fleet.operations.recycling`) asks for one when a worker passes
  `--max-requests` (plus its jitter) or `--max-worker-memory`; it is a rolling restart
  of that slot, deferred while a checkpoint or another operation runs.

One rule holds across them all: none may leave no live worker taking new sessions (a
drain of the last one, or a shrink that keeps only draining ones, is refused first).

Signals (gunicorn's and uvicorn's): HUP restarts every slot, TTIN adds a worker, TTOU
removes one; they queue and run one after the other when the server is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from gym_proxy.coordinator.contract.answers import OperationReport, OperationsStatus, WorkerStatus
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.exclusion import Exclusion
from gym_proxy.proxy.fleet.moves.mover import GAVE_WAY, Mover
from gym_proxy.proxy.fleet.operations.decommission import (
    Decommissioner,
    Progress,
    SlotEntry,
    WorkerPool,
)
from gym_proxy.proxy.fleet.operations.recycling import RecyclePolicy
from gym_proxy.proxy.fleet.supervision.worker_records import WorkerProcess

__all__ = ["Operations", "WorkerPool", "Progress", "RESTART_PAUSE"]

log = logging.getLogger("gym_proxy.operations")

# A queued signal's operation runs as the exclusion becomes free (woken by it); this is
# only how long one wait lasts before it looks again.
SIGNAL_WAIT = 60.0
RECYCLE_BACKOFF = 60.0  # seconds before a failed recycle of a slot is tried again
RESTART_PAUSE = 1.0  # seconds between the slots of a rolling restart (module docstring)

T = TypeVar("T")


@dataclass(eq=False)
class Operations:
    pool: WorkerPool
    mover: Mover
    exclusion: Exclusion
    running: Progress | None = None
    last: Progress | None = None
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    _signals: list[str] = field(default_factory=list)
    _signal_task: asyncio.Task[None] | None = None
    _recycle_not_before: dict[int, float] = field(default_factory=dict)
    # Told each operation's kind, outcome (complete, incomplete, error) and seconds.
    observe: Callable[[str, str, float], None] | None = None
    decommissioner: Decommissioner = field(init=False)
    recycling: RecyclePolicy = field(init=False)  # its `watch` runs while the server serves

    def __post_init__(self) -> None:
        self.decommissioner = Decommissioner(
            self.pool, self.mover, self.exclusion, self._exclusive, self._in_background
        )
        self.recycling = RecyclePolicy(self.pool.config, lambda: self.pool.slots, self.recycle)

    # ---- the operations -------------------------------------------------------------
    async def drain(self, slot: int, within: float) -> OperationReport:
        """No new sessions on the slot's worker; move its sessions to the others."""
        async with self._exclusive("drain", "operator") as progress:
            worker = self._live_in(slot)
            self._keep_one_taking_sessions([worker], f"draining slot {slot}")
            self._set_drained(worker, True)
            deadline = time.monotonic() + within
            progress.at(
                "moving_sessions", slot, f"slot {slot}: moving its sessions to the other workers"
            )
            left = await self.decommissioner.empty(
                worker, lambda: self._others(worker), deadline, progress
            )
            if left is None:
                left = await self.decommissioner.held_sessions(worker)
                progress.errors.append(f"slot {slot} did not list its sessions")
            progress.slot(slot, owner=worker.owner, draining=True, sessions_left=len(left))
            if left:
                progress.errors.append(
                    f"slot {slot} still holds {len(left)} sessions at the timeout "
                    + self.decommissioner.why_left(left, progress)
                )
            return self._answer(progress)

    async def undrain(self, slot: int) -> OperationReport:
        """The slot's worker takes new sessions again."""
        async with self._exclusive("undrain", "operator") as progress:
            worker = self._live_in(slot)
            self._set_drained(worker, False)
            progress.slot(slot, owner=worker.owner, draining=False)
            return self._answer(progress)

    async def restart(
        self,
        slots: list[int] | None,
        within: float,
        reason: str = "operator",
        pause: float = RESTART_PAUSE,
    ) -> OperationReport:
        """Rolling restart of `slots` (None: every slot), one at a time, `pause` seconds
        apart (module docstring)."""
        async with self._exclusive("restart", reason) as progress:
            order = list(range(len(self.pool.slots))) if slots is None else list(slots)
            for slot in order:
                self._live_in(slot)
            for i, slot in enumerate(order):
                if i and pause > 0:
                    progress.at("pausing", slot, f"pausing {pause:g} s before slot {slot}")
                    await asyncio.sleep(pause)
                if not await self._restart_slot(slot, within, progress):
                    break
            return self._answer(progress)

    async def resize(
        self, workers: int, within: float, reason: str = "operator", yields: bool = False
    ) -> OperationReport:
        """Grow or shrink to `workers` slots while serving; `yields`: gym-proxy's own
        (the autoscaler's), it gives way (module docstring)."""
        if workers < 1:
            raise GymError("invalid_request", "workers must be at least 1")
        async with self._exclusive("resize", reason, yields) as progress:
            boot = float(self.pool.config.boot_timeout or within)
            while len(self.pool.slots) < workers and not self.exclusion.giving_way:
                progress.at(
                    "starting_worker",
                    len(self.pool.slots),
                    f"starting worker {len(self.pool.slots)}",
                )
                try:
                    worker = await self._unless_asked(self.pool.add_slot(boot))
                except Exception as exc:  # WorkerBootError: the server keeps its size
                    progress.errors.append(f"grow stopped at {len(self.pool.slots)} workers: {exc}")
                    break
                if worker is not None:
                    progress.slot(worker.slot, owner=worker.owner, added=True)
            if workers < len(self.pool.slots):
                self._check_shrink(workers)
            while len(self.pool.slots) > workers and not self.exclusion.giving_way:
                slot = len(self.pool.slots) - 1
                progress.at("removing_slot", slot, f"removing slot {slot}")
                old = self.pool.slots.current(slot)
                entry = progress.slot(slot, removed=True)
                if old is not None and yields:
                    entry.note(owner=old.owner)
                    if not await self._take_out_or_keep(old, within, progress, entry):
                        break
                    continue
                self.pool.remove_last_slot()
                if old is not None:
                    entry.note(owner=old.owner)
                    await self.decommissioner.decommission(
                        old, self._heirs, within, progress, entry
                    )
            gave_way = self.exclusion.giving_way
            if gave_way:
                progress.errors.append(f"{GAVE_WAY}: {_workers(len(self.pool.slots))} kept")
            return self._answer(progress, workers=len(self.pool.slots), gave_way=gave_way)

    async def _take_out_or_keep(
        self, old: WorkerProcess, within: float, progress: Progress, entry: SlotEntry
    ) -> bool:
        """A shrink that gives way: `old` leaves its slot only once taken out; else it
        keeps it (`Decommissioner.take_out_or_keep`). True when its slot was removed."""
        deadline = time.monotonic() + within
        if not await self.decommissioner.take_out_or_keep(old, self._heirs, deadline, progress):
            alive = old.state == "live"  # one that died is replaced in its slot, as any
            outcome = "kept: it serves on in its slot" if alive else "died while it was emptied"
            entry.note(removed=False, outcome=outcome)
            if not self.exclusion.giving_way:
                reasons = "; ".join(sorted(set(progress.failed.values()))) or "a request ran on"
                progress.errors.append(
                    f"slot {old.slot} kept: its worker could not be emptied in {within:g} s "
                    f"({reasons})"
                )
            return False
        self.pool.remove_last_slot()
        entry.note(outcome="stopped")
        await self.pool.stop_worker(old, float(self.pool.config.graceful_timeout))
        return True

    async def _unless_asked(self, step: Awaitable[T]) -> T | None:
        """`step`, or None when the operation (one that gives way) is asked to give way
        first: `step` is cancelled then (what finished before the cancel is kept)."""
        asked = self.exclusion.asked
        if asked is None:
            return await step
        task = asyncio.ensure_future(step)
        either: set[asyncio.Future[Any]] = {task, asked}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
        return None if task.cancelled() else task.result()

    def recycle(self, slot: int, reason: str) -> None:
        """The recycle policy's ask: a rolling restart of one slot, when the server is
        free (it asks again every interval, so a deferred recycle happens later; one that
        failed is not tried again for RECYCLE_BACKOFF seconds)."""
        if not self.exclusion.is_free():
            return
        if self._recycle_not_before.get(slot, 0.0) > time.monotonic():
            return
        log.info("recycling worker %d: %s", slot, reason)
        within = float(self.pool.config.graceful_timeout or 30.0)
        self._in_background(self._recycle(slot, within, f"recycle: {reason}"))

    async def _recycle(self, slot: int, within: float, reason: str) -> None:
        # Set before the first await: the supervisor asks again each interval.
        self._recycle_not_before[slot] = time.monotonic() + RECYCLE_BACKOFF
        try:
            answer = await self.restart([slot], within, reason)
        except GymError as exc:
            log.warning("recycle of worker %d not run: %s", slot, exc.detail)
            self._recycle_not_before.pop(slot, None)
            return
        if answer.complete:
            self._recycle_not_before.pop(slot, None)

    def on_signal(self, name: str) -> None:
        """HUP, TTIN or TTOU: queued, run one after the other when the server is free."""
        self._signals.append(name)
        if self._signal_task is None or self._signal_task.done():
            self._signal_task = asyncio.ensure_future(self._run_signals())

    # ---- the steps ----------------------------------------------------------------
    def _set_drained(self, worker: WorkerProcess, drained: bool) -> None:
        """An operator's drain (or undrain): kept for a successor that adopts it."""
        worker.live_route.draining = drained
        self.pool.intent.set_drained(worker.owner, drained)

    async def _restart_slot(self, slot: int, within: float, progress: Progress) -> bool:
        old = self._live_in(slot)
        entry = progress.slot(slot, old_owner=old.owner, old_pid=old.pid)
        progress.at("starting_replacement", slot, f"slot {slot}: starting its replacement")
        boot = float(self.pool.config.boot_timeout or within)
        try:
            new = await self.pool.start_successor(slot, boot)
        except Exception as exc:  # WorkerBootError: the old worker keeps serving
            entry.note(outcome="kept: the replacement did not boot")
            progress.errors.append(f"slot {slot}: {exc}; the restart stopped here")
            return False
        entry.note(new_owner=new.owner, new_pid=new.pid)
        self.pool.slots.promote(new)
        progress.at("moving_sessions", slot, f"slot {slot}: moving its sessions to the replacement")
        await self.decommissioner.decommission(
            old, lambda: self._slot_worker(slot), within, progress, entry
        )
        return True

    def _live_in(self, slot: int) -> WorkerProcess:
        worker = self.pool.slots.current(slot) if isinstance(slot, int) else None
        if worker is None:
            raise GymError("invalid_request", f"no live worker in slot {slot}")
        return worker

    def _serving(self) -> list[WorkerProcess]:
        """Each slot's live worker."""
        slots = self.pool.slots
        return [w for i in range(len(slots)) if (w := slots.current(i)) is not None]

    def _heirs(self) -> list[WorkerProcess]:
        """Where a removed slot's sessions go: the workers taking sessions and answering,
        else (all draining) any left."""
        serving = self._serving()
        return [
            w for w in serving if not w.live_route.draining and w.live_route.responsive
        ] or serving

    def _others(self, worker: WorkerProcess) -> list[WorkerProcess]:
        """The workers a drained one's sessions may go to: taking sessions, answering."""
        return [
            w
            for w in self._serving()
            if w is not worker and not w.live_route.draining and w.live_route.responsive
        ]

    def _check_shrink(self, workers: int) -> None:
        """A shrink to `workers` slots keeps the rule below (refused first otherwise)."""
        removed = range(workers, len(self.pool.slots))
        leaving = [w for i in removed if (w := self.pool.slots.current(i)) is not None]
        self._keep_one_taking_sessions(leaving, f"resizing to {_workers(workers)}")

    def _keep_one_taking_sessions(self, leaving: list[WorkerProcess], what: str) -> None:
        """The rule every operation that takes workers out of new sessions keeps, here
        and nowhere else: a live worker outside `leaving` that is not draining stays, so
        new sessions always have somewhere to go. Refused (400) before anything changes."""
        staying = [w for w in self._serving() if w not in leaving]
        if any(not w.live_route.draining for w in staying):
            return
        if not staying:
            why = "no other live worker"
        elif len(staying) == 1:
            why = f"slot {staying[0].slot} is draining: undrain it first"
        else:
            slots = ", ".join(str(w.slot) for w in staying)
            why = f"slots {slots} are draining: undrain one first"
        raise GymError(
            "invalid_request", f"{what} would leave no worker taking new sessions ({why})"
        )

    def _slot_worker(self, slot: int) -> list[WorkerProcess]:
        worker = self.pool.slots.current(slot)
        return [] if worker is None else [worker]

    # ---- exclusion, progress, background ------------------------------------------
    @contextlib.asynccontextmanager
    async def _exclusive(
        self, kind: str, reason: str, yields: bool = False
    ) -> AsyncIterator[Progress]:
        async with self.exclusion.acquire(kind, yields), self._progress(kind, reason) as progress:
            yield progress

    @contextlib.asynccontextmanager
    async def _progress(self, kind: str, reason: str) -> AsyncIterator[Progress]:
        progress = self.running = Progress(kind, reason, time.time())
        started = time.monotonic()
        outcome = "error"
        try:
            yield progress
            outcome = "incomplete" if progress.errors else "complete"
        finally:
            progress.seconds = round(time.monotonic() - started, 6)
            # Counted once per operation (a retire asks again and again while it waits).
            self.mover.episodes_moved_total += progress.episodes_moved
            self.mover.episodes_failed_total += len(progress.episodes_failed)
            if self.observe is not None:
                self.observe(kind, outcome, progress.seconds)
            progress.at("done", None, "")
            self.running, self.last = None, progress
            log.info(
                "%s (%s) done in %.3f s: %d sessions moved, %d not%s",
                kind,
                reason,
                progress.seconds,
                progress.moved,
                len(progress.failed),
                "".join(f"; {e}" for e in progress.errors),
            )

    def _answer(
        self, progress: Progress, workers: int | None = None, gave_way: bool | None = None
    ) -> OperationReport:
        return progress.view(
            self.mover.holding,
            seconds=round(time.time() - progress.started_at, 6),
            complete=not progress.errors,
            workers=workers,
            gave_way=gave_way,
        )

    def status(self) -> OperationsStatus:
        """The running operation's progress and the last one's outcome (each worker's
        state is in status' one `workers` list: `describe`)."""
        waiting = self.mover.holding
        return OperationsStatus(
            None if self.running is None else self.running.view(waiting),
            None if self.last is None else self.last.view(0),
        )

    def describe(self, status: WorkerStatus) -> WorkerStatus:
        """A registered worker's status with the fleet's view of it: its state
        (`WorkerProcess.status`), requests served, node (the Ray node ID, `local` for
        this machine's process) and address."""
        worker = next((w for w in self.pool.slots.workers() if w.owner == status.owner), None)
        if worker is None:
            return status
        route = worker.route
        slots = self.pool.slots
        return replace(
            status,
            state=worker.status,
            requests_served=worker.live_route.served if route else 0,
            node=worker.node or "local",
            address=route.address if route else worker.socket_path,
            memory_bytes=worker.memory(),
            sessions=worker.reported_sessions,
            restarts=slots[worker.slot].restarts if 0 <= worker.slot < len(slots) else 0,
        )

    async def _run_signals(self) -> None:
        while self._signals:
            if not await self.exclusion.until_free(SIGNAL_WAIT):
                continue
            name = self._signals.pop(0)
            within = float(self.pool.config.graceful_timeout or 30.0)
            count = len(self.pool.slots)
            # One line per signal taken, saying what it does: signals of one kind that
            # come faster than they are taken merge in the kernel (docs/live_operations.md).
            if name == "HUP":
                log.info("SIGHUP: rolling restart of %s", _workers(count))
                await self._quietly("SIGHUP", self.restart(None, within, "SIGHUP"))
            elif name == "TTIN":
                log.info("SIGTTIN: resizing %d -> %s", count, _workers(count + 1))
                await self._quietly("SIGTTIN", self.resize(count + 1, within, "SIGTTIN"))
            elif name == "TTOU" and count > 1:
                try:
                    self._check_shrink(count - 1)
                except GymError as exc:
                    log.warning("SIGTTOU not run: %s", exc.detail)
                    continue
                log.info("SIGTTOU: resizing %d -> %s", count, _workers(count - 1))
                await self._quietly("SIGTTOU", self.resize(count - 1, within, "SIGTTOU"))
            elif name == "TTOU":
                log.warning("SIGTTOU ignored: the server has one worker left")

    async def _quietly(self, name: str, operation: Awaitable[object]) -> None:
        try:
            await operation
        except GymError as exc:
            log.warning("%s not run: %s", name, exc.detail)

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def close(self) -> None:
        """Stop background work (the server is stopping)."""
        for task in list(self._background):
            task.cancel()
        if self._signal_task is not None:
            self._signal_task.cancel()


def _workers(count: int) -> str:
    return f"{count} worker" if count == 1 else f"{count} workers"
