"""`--min-workers`/`--max-workers`: the worker count follows demand.

The policy (`ScalePolicy`, pure) judges the loads of `proxy.fleet.balance.load`:

- **grow** by one when every worker that takes sessions has run at least `up_busy`
  requests on average (`--scale-up-busy`), or is stalled, without a break for `up_after`
  seconds, and the count is under `--max-workers`;
- **shrink** by one when every worker has run under `down_busy` (`--scale-down-busy`)
  for `down_after` seconds and the count is over `--min-workers`;
- after either, a streak starts again from nothing, after `cooldown` seconds (5): a new
  worker's average starts at 0, so "every worker busy" needs it busy too.

`Autoscaler` carries a decision out as a resize (`Operations.resize`, reason
`autoscale`): a grow starts a worker (on the cluster too, placed); a shrink drains the
last slot, its sessions moved, its episodes handed over, as an operator's resize does. It
never acts while a checkpoint is open, an operation runs or a take-over hands the
workers on (the round is skipped and said, as a rebalance's), and never outside the
bounds. Its resize is gym-proxy's own choice, so it gives way (`coordinator.exclusion`):
a checkpoint, an operator's operation or a take-over that comes while it runs asks it to,
and it stops with the worker count it had; the streak that called for it goes on, and
the same resize is made again once the way is free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from gym_proxy.coordinator.contract.answers import (
    AutoscaleDecision,
    AutoscaleStatus,
    OperationReport,
)
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.proxy.fleet.balance.load import WorkerLoad

__all__ = ["ScaleBounds", "ScalePolicy", "Autoscaler"]

log = logging.getLogger("gym_proxy.autoscale")

RESIZE_WITHIN = 30.0  # seconds a shrink's drain may take
GAVE_WAY = "it gave way to a checkpoint or an operator's operation"


@dataclass(frozen=True)
class ScaleBounds:
    least: int
    most: int
    up_busy: float = 4.0
    down_busy: float = 0.5
    up_after: float = 10.0
    down_after: float = 60.0
    cooldown: float = 5.0


@dataclass
class ScalePolicy:
    bounds: ScaleBounds
    _up_since: float | None = None
    _down_since: float | None = None
    _quiet_until: float = 0.0

    def judge(
        self, loads: Mapping[str, WorkerLoad], stalled: set[str], count: int, now: float
    ) -> tuple[int, str]:
        """(+1, why), (-1, why) or (0, "")."""
        b = self.bounds
        taking = [w for w in loads.values() if w.taking]
        if count < b.least:
            return 1, f"{count} workers, under --min-workers {b.least}"
        if count > b.most:
            return -1, f"{count} workers, over --max-workers {b.most}"
        if not taking or now < self._quiet_until:
            self._up_since = self._down_since = None
            return 0, ""
        busy = all(w.busy >= b.up_busy or w.owner in stalled for w in taking)
        idle = all(w.busy < b.down_busy for w in loads.values())
        self._up_since = _streak(self._up_since, now, busy and count < b.most)
        self._down_since = _streak(self._down_since, now, idle and count > b.least)
        if self._up_since is not None and now - self._up_since >= b.up_after:
            average = sum(w.busy for w in taking) / len(taking)
            return 1, f"every worker busy ({average:.1f} requests on average) for {b.up_after:g} s"
        if self._down_since is not None and now - self._down_since >= b.down_after:
            return -1, f"every worker under {b.down_busy:g} requests for {b.down_after:g} s"
        return 0, ""

    def scaled(self, now: float) -> None:
        self._quiet_until = now + self.bounds.cooldown
        self._up_since = self._down_since = None


def _streak(since: float | None, now: float, holds: bool) -> float | None:
    """When a condition that `holds` now began (None: it does not hold)."""
    if not holds:
        return None
    return now if since is None else since


@dataclass(eq=False)
class Autoscaler:
    policy: ScalePolicy
    # (count, within, reason, yields): `Operations.resize`
    resize: Callable[[int, float, str, bool], Awaitable[OperationReport]]
    count: Callable[[], int]
    grown: int = 0  # /metrics: resizes it made, each way
    shrunk: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    last: AutoscaleDecision | None = None  # for `status` (and the status page)
    _skipping: str = ""

    def status(self) -> AutoscaleStatus:
        bounds = self.policy.bounds
        return AutoscaleStatus(bounds.least, bounds.most, self.last)

    def _decided(self, count: int, to: int, why: str, outcome: str) -> None:
        self.last = AutoscaleDecision(time.time(), count, to, why, outcome)

    async def judge(
        self, loads: Mapping[str, WorkerLoad], stalled: set[str], in_the_way: str, now: float
    ) -> None:
        count = self.count()
        step, why = self.policy.judge(loads, stalled, count, now)
        if not step:
            return
        if in_the_way:
            self._skip(in_the_way, count + step)
            self._decided(count, count + step, why, f"skipped: {in_the_way}")
            return
        self._skipping = ""
        log.info("autoscale: %d -> %d workers: %s", count, count + step, why)
        try:
            reply = await self.resize(count + step, RESIZE_WITHIN, "autoscale", True)
        except GymError as exc:  # something began meanwhile: the next round sees it
            log.info("autoscale to %d workers not done: %s", count + step, exc.detail)
            self.policy.scaled(time.monotonic())
            self._decided(count, count + step, why, f"not done: {exc.detail}")
            return
        if reply.gave_way:
            # Not `scaled`: its streak goes on, so the same resize is made again once
            # nothing is in the way (unless the load changed meanwhile).
            self._skip(GAVE_WAY, count + step)
            self._decided(count, count + step, why, f"skipped: {GAVE_WAY}")
            return
        outcome = "made" if reply.complete is not False else "; ".join(reply.errors)
        self._decided(count, count + step, why, outcome)
        self.policy.scaled(time.monotonic())
        # Counted when made: a boot can fail, a worker be left unemptied (said below).
        if reply.workers == count + step:
            if step > 0:
                self.grown += 1
            else:
                self.shrunk += 1
        if reply.complete is False:
            log.warning("autoscale to %d workers: %s", count + step, "; ".join(reply.errors))

    def _skip(self, why: str, to: int) -> None:
        """A resize to `to` workers not made (or not finished) for `why`: counted, and
        said once a streak."""
        self.skipped[why] = self.skipped.get(why, 0) + 1
        if self._skipping != why:
            self._skipping = why
            log.info("autoscale to %d workers skipped: %s", to, why)
