"""When a worker sheds sessions, and to whom: the policy of `--rebalance`, pure.

Two reasons, judged on the loads of `proxy.fleet.load`:

- **stalled**: its event loop's lag peak reached `stall` seconds. It takes no new
  sessions (`WorkerRoute.stalled`) and sheds every idle session it holds, so that the
  sessions that did not cause the stall stop waiting behind it. It is stalled until the
  peak falls under half of `stall` (hysteresis: a loop that blocks again and again stays
  stalled between its blocks).
- **hot**: it runs at least `min_busy` requests on average and at least `ratio` times
  the average of the other workers that take sessions, or its loop's delay is at least
  `HOT_DELAY` and `ratio` times theirs (a loop blocked in stretches: each session there
  waits behind them), without a break for `sustain` seconds. It sheds that share of its
  idle sessions which the excess is of its load (or delay). A `ratio` of 0 turns this
  rule off: only a stalled worker sheds.

It never flaps: a worker that took sessions is left alone for `cooldown` seconds (it
neither sheds nor takes more), so nothing bounces back; one that shed may shed again
after `sustain` while it stays hot or stalled (only away from it); the whole server
moves at most `max_moves` sessions a second (a bucket of one second's worth).
Targets are the workers that take sessions, neither stalled nor hot themselves, and
(for a hot source) under `1/ratio` of its load (or delay), least busy first. Which
sessions are idle (no request running) is the balancer's to say, when it acts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gym_proxy.proxy.fleet.load import WorkerLoad

__all__ = ["Thresholds", "Shed", "RebalancePolicy"]

HOT = "hot"
STALLED = "stalled"
# A loop this late (and `ratio` times the others') is hot by its delay: it blocks in
# stretches the others do not (asyncio's own mark of a slow callback is 0.1 s).
HOT_DELAY = 0.05


@dataclass(frozen=True)
class Thresholds:
    ratio: float = 2.0
    min_busy: float = 2.0
    stall: float = 1.0
    sustain: float = 3.0
    cooldown: float = 10.0
    max_moves: float = 10.0


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


@dataclass
class RebalancePolicy:
    thresholds: Thresholds = field(default_factory=Thresholds)
    stalled: set[str] = field(default_factory=set)
    _hot_since: dict[str, float] = field(default_factory=dict)
    _quiet_until: dict[str, float] = field(default_factory=dict)
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
        sheds: list[Shed] = []
        for owner in sorted(self.stalled, key=lambda o: loads[o].slot):
            load = loads[owner]
            targets = self._targets(healthy, now, float("inf"), float("inf"))
            if targets and self._quiet_until.get(owner, 0.0) <= now:
                why = f"event-loop lag {load.lag_peak:.2f} s (threshold {t.stall:g} s)"
                sheds.append(Shed(owner, load.slot, targets, 1.0, STALLED, why))
        judged = {
            owner: self._hot(load, [w for o, w in healthy.items() if o != owner])
            for owner, load in healthy.items()
        }
        cool = {o: w for o, w in healthy.items() if judged[o] is None}  # what may take
        for owner, load in sorted(healthy.items(), key=lambda item: -item[1].busy):
            hot = judged[owner]
            if hot is None:
                self._hot_since.pop(owner, None)
                continue
            since = self._hot_since.setdefault(owner, now)
            if now - since < t.sustain or self._quiet_until.get(owner, 0.0) > now:
                continue
            share, why, busy_below, lag_below = hot
            targets = self._targets(cool, now, busy_below, lag_below)
            if targets:
                sheds.append(Shed(owner, load.slot, targets, share, HOT, why))
        return sheds

    def _hot(
        self, load: WorkerLoad, others: list[WorkerLoad]
    ) -> tuple[float, str, float, float] | None:
        """(share, why, and the busy and delay a target must be under) when `load` is hot
        against `others` by its requests or by its loop's delay; None when it is not."""
        t = self.thresholds
        if not others or not t.ratio:
            return None
        busy = sum(w.busy for w in others) / len(others)
        if load.busy >= t.min_busy and load.busy >= t.ratio * busy:
            why = f"{load.busy:.1f} requests on average against {busy:.1f} on the others"
            share = min(1.0, (load.busy - busy) / load.busy)
            return share, why, load.busy / t.ratio, float("inf")
        lag = sum(w.lag_peak for w in others) / len(others)
        if load.lag_peak >= HOT_DELAY and load.lag_peak >= t.ratio * lag:
            why = (
                f"event-loop delay {1000 * load.lag_peak:.0f} ms against "
                f"{1000 * lag:.0f} ms on the others"
            )
            share = min(1.0, (load.lag_peak - lag) / load.lag_peak)
            return share, why, float("inf"), load.lag_peak / t.ratio
        return None

    def _targets(
        self, healthy: Mapping[str, WorkerLoad], now: float, busy: float, lag: float
    ) -> tuple[str, ...]:
        """Who may take sessions: under `busy` requests and `lag` seconds of delay, the
        resting ones only if no other is."""
        ready = [w for w in healthy.values() if w.busy <= busy and w.lag_peak <= lag]
        ready = [w for w in ready if self._quiet_until.get(w.owner, 0.0) <= now] or ready
        return tuple(w.owner for w in sorted(ready, key=lambda w: (w.busy, w.slot)))

    def shed(self, shed: Shed, targets_used: list[str], now: float) -> None:
        """`shed` was carried out onto `targets_used`: they rest for `cooldown` (nothing
        bounces back); the source for `sustain`, then sheds again while it stays hot or
        stalled (what was busy in it sheds as it turns idle)."""
        t = self.thresholds
        for owner in targets_used:
            self._quiet_until[owner] = now + t.cooldown
        self._quiet_until[shed.source] = now + t.sustain
        self._hot_since.pop(shed.source, None)

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
