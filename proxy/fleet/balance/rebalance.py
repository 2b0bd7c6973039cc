"""When a worker sheds sessions, which ones, and to whom: the policy of `--rebalance`,
pure.

Two reasons, judged on the loads of `proxy.fleet.balance.load`:

- **stalled**: its event loop's lag peak reached `stall` seconds. It takes no new
  sessions (`WorkerRoute.stalled`) and sheds every idle session it holds, so that the
  sessions that did not cause the stall stop waiting behind it. It is stalled until the
  peak falls under half of `stall` (hysteresis: a loop that blocks again and again stays
  stalled between its blocks).
- **hot**: it runs at least `min_busy` requests on average and at least `ratio` times
  what the other workers that take sessions typically run (the lower median of theirs:
  a second hot worker among them does not hide the first), or its loop's delay is at
  least `HOT_DELAY` and `ratio` times theirs (a loop blocked in stretches: each session
  there waits behind them), without a break for `sustain` seconds. It sheds that share of
  its idle sessions which the excess is of its load (or delay). A `ratio` of 0 turns this
  rule off: only a stalled worker sheds.

Which sessions: idle ones (no request running; the balancer looks, twice), but never
one that carries the worker's load (`carriers`: its recent share of the loop's delay or
of the requests' running time, as the worker measures them, `worker.session_load`):
moved, its load would follow it and make its new worker hot in turn. The least costly
go first. A session a rebalance moved stays where it went for `settle` seconds, and
never goes back to a worker that shed it.

To whom: the workers that take sessions, neither stalled nor hot themselves, under
`1/ratio` of the source on the measure it sheds by, and not loaded enough on the other
to be hot (under `min_busy` requests, or `HOT_DELAY` of delay, or `1/ratio` of the
source's), least busy first.

It never flaps: a worker that took sessions is left alone for `cooldown` seconds (it
neither sheds nor takes more, unless no other worker may take), so nothing bounces back
at once; one that shed may shed again after `sustain` while it stays hot or stalled
(only away from it); the whole server moves at most `max_moves` sessions a second (a
bucket of one second's worth).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from gym_proxy.proxy.fleet.balance.load import WorkerLoad

__all__ = ["Thresholds", "Shed", "Cost", "RebalancePolicy", "carriers"]

HOT = "hot"
STALLED = "stalled"
# A loop this late (and `ratio` times the others') is hot by its delay: it blocks in
# stretches the others do not (asyncio's own mark of a slow callback is 0.1 s).
HOT_DELAY = 0.05
# A session carries its worker's load with this many times an even share of the
# sessions charged anything (or, among fewer than this squared, half of it all).
CARRY = 2.0
REMEMBER = 600.0  # seconds a moved session's former workers are remembered
RATIO_OFF = 2.0  # the margin targets keep under a stalled source when `ratio` is 0

By = Literal["busy", "delay"]


@dataclass(frozen=True)
class Thresholds:
    ratio: float = 2.0
    min_busy: float = 2.0
    stall: float = 1.0
    sustain: float = 3.0
    cooldown: float = 10.0
    max_moves: float = 10.0
    settle: float = 30.0  # seconds a moved session stays where it went


@dataclass(frozen=True)
class Shed:
    """`source` (slot `slot`) gives `share` of its idle sessions to `targets` (owners,
    least busy first), for `reason` ("hot" or "stalled"); `why` gives the figures."""

    source: str
    slot: int
    targets: tuple[str, ...]
    share: float
    reason: str
    why: str


class Cost(NamedTuple):
    """What a session cost its worker lately: the loop's delay charged to it, and its
    requests' running time, seconds (`worker.session_load`)."""

    delay: float = 0.0
    busy: float = 0.0


def carriers(costs: Mapping[str, Cost]) -> dict[str, str]:
    """The sessions that carry the load of the worker whose sessions cost `costs`, each
    with why: a share of the loop's delay, or of the requests' time, of at least `CARRY`
    times an even share among the sessions charged any (half of it all, among few)."""
    found: dict[str, str] = {}
    for index, what in ((0, "the loop's delay"), (1, "the requests' time")):
        charged = {s: cost[index] for s, cost in costs.items() if cost[index] > 0}
        total = sum(charged.values())
        if not charged or total <= 0:
            continue
        bar = min(CARRY / len(charged), 1 / CARRY)
        for session_id, spent in charged.items():
            if spent / total >= bar and session_id not in found:
                found[session_id] = f"it carries {100 * spent / total:.0f}% of {what}"
    return found


@dataclass
class _Moved:
    at: float  # when a rebalance last moved it (monotonic)
    origins: set[str]  # the workers that shed it


@dataclass
class RebalancePolicy:
    thresholds: Thresholds = field(default_factory=Thresholds)
    stalled: set[str] = field(default_factory=set)
    _hot_since: dict[str, float] = field(default_factory=dict)
    _quiet_until: dict[str, float] = field(default_factory=dict)
    _moves: dict[str, _Moved] = field(default_factory=dict)
    _tokens: float = 0.0
    _filled_at: float | None = None

    def judge(self, loads: Mapping[str, WorkerLoad], now: float) -> list[Shed]:
        """Who sheds now (updates who is stalled, and the hot streaks)."""
        t = self.thresholds
        for owner, load in loads.items():
            if load.lag_peak >= t.stall:
                self.stalled.add(owner)
            elif load.lag_peak < t.stall / 2:
                self.stalled.discard(owner)
        self.stalled &= loads.keys()
        healthy = {o: w for o, w in loads.items() if w.taking and o not in self.stalled}
        judged = {
            owner: self._hot(load, [w for o, w in healthy.items() if o != owner])
            for owner, load in healthy.items()
        }
        cool = {o: w for o, w in healthy.items() if judged[o] is None}  # what may take
        sheds: list[Shed] = []
        for owner in sorted(self.stalled, key=lambda o: loads[o].slot):
            load = loads[owner]
            targets = self._targets(cool, load, "delay", now)
            if targets and self._quiet_until.get(owner, 0.0) <= now:
                why = f"event-loop lag {load.lag_peak:.2f} s (threshold {t.stall:g} s)"
                sheds.append(Shed(owner, load.slot, targets, 1.0, STALLED, why))
        for owner, load in sorted(healthy.items(), key=lambda item: -item[1].busy):
            hot = judged[owner]
            if hot is None:
                self._hot_since.pop(owner, None)
                continue
            since = self._hot_since.setdefault(owner, now)
            if now - since < t.sustain or self._quiet_until.get(owner, 0.0) > now:
                continue
            share, why, by = hot
            targets = self._targets(cool, load, by, now)
            if targets:
                sheds.append(Shed(owner, load.slot, targets, share, HOT, why))
        return sheds

    def _hot(self, load: WorkerLoad, others: list[WorkerLoad]) -> tuple[float, str, By] | None:
        """(share, why, and the measure) when `load` is hot against `others` by its
        requests or by its loop's delay; None when it is not."""
        t = self.thresholds
        if not others or not t.ratio:
            return None
        busy = _typical([w.busy for w in others])
        if load.busy >= t.min_busy and load.busy >= t.ratio * busy:
            why = f"{load.busy:.1f} requests on average against {busy:.1f} on the others"
            return min(1.0, (load.busy - busy) / load.busy), why, "busy"
        lag = _typical([w.lag_peak for w in others])
        if load.lag_peak >= HOT_DELAY and load.lag_peak >= t.ratio * lag:
            why = (
                f"event-loop delay {1000 * load.lag_peak:.0f} ms against "
                f"{1000 * lag:.0f} ms on the others"
            )
            return min(1.0, (load.lag_peak - lag) / load.lag_peak), why, "delay"
        return None

    def _targets(
        self, cool: Mapping[str, WorkerLoad], source: WorkerLoad, by: By, now: float
    ) -> tuple[str, ...]:
        """Who may take `source`'s sessions (the module docstring), the resting ones only
        if no other may."""
        ready = [w for w in cool.values() if self._takes(w, source, by)]
        ready = [w for w in ready if self._quiet_until.get(w.owner, 0.0) <= now] or ready
        return tuple(w.owner for w in sorted(ready, key=lambda w: (w.busy, w.slot)))

    def _takes(self, target: WorkerLoad, source: WorkerLoad, by: By) -> bool:
        """`target` is under `1/ratio` of `source` on the measure `by`, and on the other
        under its hot floor or `1/ratio` of the source's too."""
        t = self.thresholds
        ratio = t.ratio or RATIO_OFF
        busy_under = target.busy * ratio <= source.busy
        lag_under = target.lag_peak * ratio <= source.lag_peak
        if by == "busy":
            return busy_under and (lag_under or target.lag_peak < HOT_DELAY)
        return lag_under and (busy_under or target.busy < t.min_busy)

    def plan(
        self,
        shed: Shed,
        idle: Sequence[str],
        costs: Mapping[str, Cost],
        budget: int,
        now: float,
    ) -> tuple[dict[str, list[str]], dict[str, str]]:
        """Which of the `idle` sessions of `shed`'s source go where (target -> sessions),
        and the idle ones kept because they carry its load (session -> why): `share` of
        the others, least costly first, at most `budget`, none moved less than `settle`
        seconds ago, each to a target that never shed it (round robin)."""
        kept = carriers(costs)
        settle = self.thresholds.settle
        candidates = [
            s
            for s in idle
            if s not in kept and (s not in self._moves or now - self._moves[s].at >= settle)
        ]
        candidates.sort(key=lambda s: costs.get(s, Cost()))
        count = min(budget, math.ceil(shed.share * len(candidates)))
        plan: dict[str, list[str]] = {}
        turn = 0
        for session_id in candidates:
            if turn >= count:
                break
            former = self._moves[session_id].origins if session_id in self._moves else set()
            choices = [t for t in shed.targets if t not in former]
            if choices:
                plan.setdefault(choices[turn % len(choices)], []).append(session_id)
                turn += 1
        return plan, {s: why for s, why in kept.items() if s in idle}

    def moved(self, source: str, moved: Mapping[str, str], now: float) -> None:
        """A rebalance moved these sessions (session -> its new worker) off `source`."""
        for session_id in moved:
            entry = self._moves.setdefault(session_id, _Moved(now, set()))
            entry.at = now
            entry.origins.add(source)
        for session_id in [s for s, m in self._moves.items() if now - m.at > REMEMBER]:
            del self._moves[session_id]

    def shed(self, shed: Shed, targets_used: list[str], now: float) -> None:
        """`shed` was carried out onto `targets_used`: they rest for `cooldown` (nothing
        bounces back); the source for `sustain`, then sheds again if it stayed hot (its
        streak unbroken) or stalled: what was busy in it sheds as it turns idle."""
        t = self.thresholds
        for owner in targets_used:
            self._quiet_until[owner] = now + t.cooldown
        self._quiet_until[shed.source] = now + t.sustain

    def budget(self, now: float) -> int:
        """How many sessions may move now (the bucket of `max_moves` a second)."""
        rate = self.thresholds.max_moves
        if self._filled_at is not None:
            self._tokens = min(rate, self._tokens + rate * (now - self._filled_at))
        else:
            self._tokens = rate
        self._filled_at = now
        return int(self._tokens)

    def spend(self, moved: int) -> None:
        self._tokens = max(0.0, self._tokens - moved)

    def forget(self, owners: set[str]) -> None:
        """Workers gone: their streaks and rests end with them."""
        for table in (self._hot_since, self._quiet_until):
            for owner in set(table) - owners:
                del table[owner]


def _typical(values: list[float]) -> float:
    """The lower median: what most of the others run, whatever one or two hot ones do."""
    return sorted(values)[(len(values) - 1) // 2]
