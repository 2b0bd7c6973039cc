"""Readiness of the participant, assembled from the workers' sequenced reports (no I/O)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gym_proxy.coordinator.contract.answers import ReadinessReport
from gym_proxy.coordinator.contract.messages import Report

__all__ = ["Readiness", "MAX_BLOCKERS"]

MAX_BLOCKERS = 100


class SlotOwner(Protocol):
    """A worker as the coordinator and the live operations name it: its slot and owner."""

    @property
    def slot(self) -> int: ...
    @property
    def owner(self) -> str: ...


@dataclass
class Readiness:
    """Latest report per worker owner for the open checkpoint, plus fail-closed markers."""

    reports: dict[str, Report] = field(default_factory=dict)
    lost: bool = False
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def reset(self) -> None:
        """A new checkpoint (or none): forget every report and every lost worker."""
        self.reports.clear()
        self.lost = False
        self._changed.set()

    def update(self, owner: str, report: Report) -> None:
        """Keep `report` unless a report with a higher sequence number is already held."""
        held = self.reports.get(owner)
        if held is not None and held.seq > report.seq:
            return  # stale: an older report arrived late
        self.reports[owner] = report
        self._changed.set()

    def forget(self, owner: str, lost_while_open: bool) -> None:
        """A worker went away; while a checkpoint is open that blocks it until resume."""
        self.reports.pop(owner, None)
        if lost_while_open:
            self.lost = True
        self._changed.set()

    def worker_ready(self, owner: str) -> bool | None:
        report = self.reports.get(owner)
        return None if report is None else report.ready

    def report(
        self, live: Sequence[SlotOwner], expected: int, kind: str = "resources"
    ) -> ReadinessReport:
        """The report across every worker: at most MAX_BLOCKERS blockers, all counted;
        `restarts` (episodes a restart-only app cannot continue) is never capped."""
        blockers: list[str] = []
        restarts: set[str] = set()
        counts: dict[str, int] = {}
        unreported = max(0, expected - len(live))
        for worker in live:
            report = self.reports.get(worker.owner)
            if report is None:
                unreported += 1
                continue
            blockers.extend(report.blockers)
            restarts.update(report.restarts)
            if not report.ready and not report.blockers:
                blockers.append(f"{kind}-worker-not-closed:{worker.slot}")
            for name, value in report.counts.items():
                counts[name] = counts.get(name, 0) + value
        head = []
        # The multi-worker markers, named as NeMo Gym's coordinators name them.
        if unreported:
            head.append(f"{kind}-workers-unreported:{unreported}")
        if self.lost:
            head.append(f"{kind}-worker-lost")
        blockers = head + blockers
        return ReadinessReport(
            not blockers, blockers[:MAX_BLOCKERS], len(blockers), counts, sorted(restarts)
        )

    async def wait_ready(self, done: Callable[[], bool], within: float) -> None:
        """Wait until `done()` holds, re-checking on every change, at most `within` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, within)
        while not done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return
