"""The slot table: the worker each slot holds, its successor, the workers leaving, and
what an operation changes in it (no I/O).

A slot is a worker's place, 0..N-1; it holds at most one worker and, while a rolling
restart runs, its successor (`Slot`). A worker an operation stops is *leaving*: out of
its slot, its exit expected. The supervisor (`proxy.fleet.supervision.supervisor`) starts, reaps and
stops the processes; which record sits where is decided here.
"""

from __future__ import annotations

from collections.abc import Iterator

from gym_proxy.coordinator.contract.messages import Register
from gym_proxy.coordinator.worker_channels import RegistrationRefused
from gym_proxy.proxy.fleet.supervision.worker_records import Slot, WorkerProcess

__all__ = ["Slots"]


class Slots:
    """The slots, in order; indexable and iterable as a list of `Slot`."""

    def __init__(self, count: int) -> None:
        self._slots = [Slot() for _ in range(count)]
        self._leaving: set[WorkerProcess] = set()
        self.trial = 0  # slots an operation is adding: their boot errors are not fatal

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots)

    def __getitem__(self, index: int) -> Slot:
        return self._slots[index]

    def workers(self) -> list[WorkerProcess]:
        """Every worker record: each slot's worker and successor, then leaving ones."""
        records = [w for s in self._slots for w in (s.worker, s.successor) if w is not None]
        return records + sorted(self._leaving - set(records), key=lambda w: w.slot)

    def current(self, index: int) -> WorkerProcess | None:
        """The live worker of the slot, if it has one."""
        if not 0 <= index < len(self._slots):
            return None
        worker = self._slots[index].worker
        return worker if worker is not None and worker.state == "live" else None

    def all_live(self) -> bool:
        """Every slot's worker has registered."""
        return all(s.worker is not None and s.worker.state == "live" for s in self._slots)

    def reserve(self, index: int, owner: str, socket_path: str, successor: bool) -> WorkerProcess:
        """A record for a worker about to start in slot `index` (as its worker, or as the
        successor an operation will put in its place), so that the slot is never started
        twice while the process starts."""
        placeholder = WorkerProcess(index, owner, socket_path, None, 0.0)  # type: ignore[arg-type]
        placeholder.on_trial = successor or self.trial > 0
        if successor:
            self._slots[index].successor = placeholder
        else:
            self._slots[index].worker = placeholder
        return placeholder

    def vacate(self, worker: WorkerProcess) -> None:
        """The slot no longer holds `worker` (as its worker or successor)."""
        if worker.slot >= len(self._slots):
            return
        slot = self._slots[worker.slot]
        if slot.worker is worker:
            slot.worker = None
        if slot.successor is worker:
            slot.successor = None

    def expected(self, registration: Register) -> WorkerProcess:
        """The starting record a (non-rejoining) registration names; RegistrationRefused
        when it names no slot, or another incarnation than the slot expects."""
        index = registration.slot
        if not 0 <= index < len(self._slots):
            raise RegistrationRefused(f"no slot {index!r}")
        slot = self._slots[index]
        for worker in (slot.worker, slot.successor):
            if worker is not None and worker.owner == registration.owner:
                if worker.state == "starting":
                    return worker
        raise RegistrationRefused(f"slot {index} does not expect owner {registration.owner!r}")

    def promote(self, successor: WorkerProcess) -> WorkerProcess | None:
        """The successor becomes its slot's worker; the worker it replaces is returned,
        out of the slot and leaving (the caller stops it)."""
        slot = self._slots[successor.slot]
        old, slot.worker, slot.successor = slot.worker, successor, None
        successor.on_trial = False
        slot.replacements += 1
        if old is not None:
            self.leave(old)
        return old

    def leave(self, worker: WorkerProcess) -> None:
        """An operation stops `worker`: its exit is expected, its slot not restarted."""
        worker.leaving = True
        self._leaving.add(worker)

    def left(self, worker: WorkerProcess) -> None:
        """`worker` exited."""
        self._leaving.discard(worker)

    def grow_to(self, count: int) -> None:
        """Empty slots at the end, up to `count`."""
        while len(self._slots) < count:
            self._slots.append(Slot())

    def remove_last(self) -> WorkerProcess | None:
        """Shrink by the last slot; its worker (returned) and successor are leaving."""
        slot = self._slots.pop()
        for worker in (slot.worker, slot.successor):
            if worker is not None:
                self.leave(worker)
        return slot.worker

    def reset(self, count: int) -> None:
        """`count` empty slots (a predecessor's worker count, before any worker rejoins)."""
        self._slots = [Slot() for _ in range(count)]
