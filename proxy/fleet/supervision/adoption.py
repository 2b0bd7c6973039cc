"""Adopting a predecessor's workers: a dead gym-proxy's (`--orphan-grace`), or those of
the one a `--take-over` replaces, which passed them on.

A gym-proxy that takes over a runtime directory where workers still listen waits up to
ADOPT_WINDOW seconds for them to rejoin (they look every 0.1 s) before the supervisor
starts the slots still empty. Each rejoining worker takes its slot as it was (a slot
past `--workers` too: the predecessor had been resized up), under a pidfd-backed handle
(`AdoptedProcess`: not this process's child) of the pid the kernel says registered
(`coordinator.worker_channels`), with its socket in the runtime directory; a worker Ray
placed rejoins over the channel this gym-proxy's launcher dialed to it, having found its
actor (`FindsLeftWorkers`), under that launcher's handle. The
predecessor's intent (its worker count, drains and aliases: `proxy.fleet.supervision.intent`)
holds, and a rejoining worker's sessions route to it whatever owner their tokens name;
a session two adopted workers hold (a move cut by the crash) stays with the one that
used it last (`proxy.fleet.supervision.adopted_copies`), the other copy is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gym_proxy.coordinator.contract import failpoints
from gym_proxy.coordinator.contract.channel import ChannelClosed, ChannelTimeout, RemoteError
from gym_proxy.coordinator.contract.messages import Drop, Register
from gym_proxy.coordinator.contract.trust import SOCKET, Untrusted, check_owned
from gym_proxy.coordinator.worker_channels import RegistrationRefused
from gym_proxy.proxy.adopted_process import AdoptedProcess
from gym_proxy.proxy.config import MAX_WORKERS
from gym_proxy.proxy.fleet.moves.mover import DROP_WAIT
from gym_proxy.proxy.fleet.supervision.adopted_copies import AdoptedCopies
from gym_proxy.proxy.fleet.supervision.intent import load_intent
from gym_proxy.proxy.fleet.supervision.launchers import FindsLeftWorkers
from gym_proxy.proxy.fleet.supervision.worker_records import WorkerHandle, WorkerProcess

if TYPE_CHECKING:
    from gym_proxy.proxy.fleet.supervision.supervisor import Supervisor

__all__ = ["Adoption", "ADOPT_WINDOW"]

log = logging.getLogger("gym_proxy.supervisor")

ADOPT_WINDOW = 5.0  # seconds the predecessor's workers get to rejoin (module docstring)
MAX_GROWTH = 64  # slots an adoption may add past those it found listening


@dataclass(eq=False)
class Adoption:
    """The adoption of the workers `orphans` counts, while this gym-proxy starts."""

    supervisor: Supervisor
    orphans: int  # the predecessor's workers still listening when this one started
    passed_on: bool  # by a predecessor that lives (--take-over), or left by a dead one
    _all_back: asyncio.Event = field(default_factory=asyncio.Event)
    _copies: AdoptedCopies = field(default_factory=AdoptedCopies)
    open: bool = True
    # The predecessor's larger worker count: grown to once the adopted workers serve.
    grow_to: int | None = None

    def take_intent(self) -> None:
        """The predecessor's worker count, drains and aliases hold here too."""
        supervisor = self.supervisor
        intent = load_intent(supervisor.runtime_dir)
        if intent is None:
            return
        ceiling = supervisor.config.max_workers or MAX_WORKERS
        if intent.workers > ceiling:
            log.warning(
                "not keeping the %d workers the dead instance had, over the %d this server "
                "may have (--max-workers, or the limit): --workers %d holds",
                intent.workers,
                ceiling,
                len(supervisor.slots),
            )
            intent = replace(intent, workers=len(supervisor.slots))
        # Taken in first: every write of the intent from now on (a resize's below) keeps
        # the drains and aliases too, for the next successor.
        supervisor.intent.adopt(intent)
        supervisor.router.aliases = dict(intent.aliases)
        if intent.workers < len(supervisor.slots):
            log.warning(
                "keeping the %d workers the dead instance was resized to (--workers %d; "
                "resize to change that)",
                intent.workers,
                len(supervisor.slots),
            )
            supervisor.slots.reset(intent.workers)
            supervisor.resized()
        elif intent.workers > len(supervisor.slots):
            # Grown by a resize once the adopted workers serve, not waited for at start:
            # a placed worker may wait minutes for room, or never find it, and a start
            # that failed for it would stop the adopted workers with every session.
            self.grow_to = intent.workers
            log.warning(
                "keeping the %d workers the dead instance was resized to (--workers %d; "
                "resize to change that): the ones not adopted start once the adopted serve",
                intent.workers,
                len(supervisor.slots),
            )

    async def window(self) -> None:
        """Wait until every worker found listening is back, or ADOPT_WINDOW; then close."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_back.wait(), ADOPT_WINDOW)
        self.open = False
        self._copies.clear()
        adopted = [s.worker for s in self.supervisor.slots if s.worker is not None]
        self.supervisor.intent.forget_drains_but({w.owner for w in adopted})
        log.info(
            "adopted %d worker%s %s (pids %s)",
            len(adopted),
            "" if len(adopted) == 1 else "s",
            "the previous instance passed on" if self.passed_on else "of the dead instance",
            ", ".join(str(w.pid) for w in adopted) or "none",
        )

    def expect(self, more: int) -> None:
        """`more` of the predecessor's workers were found (placed ones, by the launcher):
        the window waits for them too, even if every worker expected so far (local ones,
        which rejoin on their own) is back already."""
        self.orphans += more
        if self._adopted() < self.orphans:
            self._all_back.clear()

    def _adopted(self) -> int:
        return sum(1 for s in self.supervisor.slots if s.worker is not None)

    def admit(self, registration: Register) -> WorkerProcess:
        """A predecessor's worker rejoins: it takes its slot, as it was."""
        if not self.open:
            raise RegistrationRefused(
                "gym-proxy adopts a dead instance's workers only while it starts"
            )
        placed = self._left(registration.socket)
        if placed is None:
            self._check_socket(registration.socket)
        slot_index = registration.slot
        self._grow_for(slot_index)
        slots = self.supervisor.slots
        if not 0 <= slot_index < len(slots):
            raise RegistrationRefused(f"no slot {slot_index!r}")
        slot = slots[slot_index]
        if slot.worker is not None:
            raise RegistrationRefused(f"slot {slot_index} has a worker already")
        process: WorkerHandle
        if placed is not None:
            process = placed
        else:
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
        self.supervisor.watch(worker)
        if self._adopted() >= self.orphans:
            self._all_back.set()  # every worker found listening is back
        return worker

    def _left(self, address: str) -> WorkerHandle | None:
        """The handle of a worker Ray placed that this gym-proxy's launcher found left by
        the predecessor, listening at `address` (its channel was dialed to it there)."""
        launcher = self.supervisor.launcher
        return launcher.left(address) if isinstance(launcher, FindsLeftWorkers) else None

    def _check_socket(self, path: str) -> None:
        """A rejoining worker's socket is where this proxy's workers listen: a socket of
        this user's, directly in the runtime directory (never a path elsewhere that new
        sessions would be routed to)."""
        directory = os.path.realpath(self.supervisor.runtime_dir)
        if os.path.dirname(os.path.realpath(path)) != directory:
            raise RegistrationRefused(f"its socket {path} is not in the runtime directory")
        try:
            info = os.lstat(path)
            check_owned(info, path, SOCKET)
        except (OSError, Untrusted) as exc:
            raise RegistrationRefused(f"its socket {path}: {exc}") from None
        if not stat.S_ISSOCK(info.st_mode):
            raise RegistrationRefused(f"its socket {path} is not a socket")

    def routed(self, worker: WorkerProcess, held: dict[str, float]) -> None:
        """An adopted worker is routable: its drain holds, and its sessions route to it
        whatever owner their tokens name (a restore or a move put some there: the
        predecessor's tables are not kept). A session another adopted worker holds too
        stays with the one that used it last; the other copy is dropped."""
        supervisor = self.supervisor
        worker.live_route.draining = worker.owner in supervisor.intent.drained
        routed, stale = self._copies.take(worker.owner, held)
        kept = supervisor.router.kept
        for session_id in routed:
            kept[session_id] = worker.owner
        by_owner = {w.owner: w for w in supervisor.slots.workers()}
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
                supervisor.track(self._drop_copies(loser, session_ids))

    async def _drop_copies(self, worker: WorkerProcess, session_ids: list[str]) -> None:
        try:
            await worker.live_channel.request(Drop(session_ids, []), within=DROP_WAIT)
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            log.warning("worker %d did not drop its older copies: %s", worker.slot, exc)

    def _grow_for(self, slot_index: int) -> None:
        """A predecessor's worker in a slot past `--workers` (it had been resized up):
        adopted, not dropped with its sessions; the server keeps that many workers."""
        slots = self.supervisor.slots
        ceiling = min(max(len(slots), self.orphans) + MAX_GROWTH, MAX_WORKERS)
        if not len(slots) <= slot_index < ceiling:
            return
        log.warning(
            "adopting worker %d beyond --workers %d (the dead instance had been resized): "
            "the server now has %d workers (resize to change that)",
            slot_index,
            len(slots),
            slot_index + 1,
        )
        slots.grow_to(slot_index + 1)
        self.supervisor.resized()
