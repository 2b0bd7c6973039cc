"""Each live worker's load, as the proxy sees it without asking the worker anything.

- `busy`: the requests it runs (`WorkerRoute.in_flight`: the proxy routed them and has
  not finished them), averaged over about `HALF_LIFE` seconds, so that one burst does not
  look like a hot worker and one quiet moment does not look like a cool one;
- `answer_seconds`: how long it takes to answer a request, on average: by Little's law,
  `busy` over the rate requests reach it (`rate`, averaged alike), so the data path
  times nothing. None while none reach it;
- `lag`: how late its event loop answers. The liveness watch pings every worker each
  second over its channel, which the worker's loop serves: the round trip of the last
  ping, or, while a ping waits, how long it has waited past its interval (a loop blocked
  by a handler cannot answer, so the lag grows while it is blocked, not after), or the
  worst lag the worker measured itself between its last two pongs (its own timer every
  0.1 s): a ping alone misses stalls that end just before each ping, such as blocks as
  long as its interval, back to back;
  `lag_peak` keeps the worst of it, decaying with the same half-life, so a loop that
  stalls again and again stays stalled between its stalls.

Sampled every `SAMPLE` seconds by `proxy.fleet.balance.balancer`; pure arithmetic here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["WorkerLoad", "LoadTracker", "HALF_LIFE", "SAMPLE", "MIN_RATE"]

HALF_LIFE = 3.0  # seconds
SAMPLE = 0.25  # seconds between samples
MIN_RATE = 0.01  # requests a second under which no answer time is told


class Sampled(Protocol):
    """What a sample reads of a worker (a `WorkerProcess` with a route)."""

    owner: str
    slot: int
    in_flight: int
    served: int  # requests routed to it so far
    ping_seconds: float | None
    loop_lag_seconds: float  # the worst the worker measured between its last two pongs
    silent_for: float  # seconds since its last pong
    taking: bool  # it takes new sessions (responsive, not draining)


@dataclass(slots=True)
class WorkerLoad:
    owner: str
    slot: int
    busy: float = 0.0
    rate: float = 0.0  # requests routed to it a second, averaged
    served: int = 0  # at the last sample
    lag: float = 0.0
    lag_peak: float = 0.0
    taking: bool = True
    samples: int = 0

    @property
    def answer_seconds(self) -> float | None:
        """Little's law: requests in flight over requests a second (None: none come)."""
        return self.busy / self.rate if self.rate > MIN_RATE else None


class LoadTracker:
    """Every live worker's `WorkerLoad`, updated by `sample`."""

    def __init__(self, ping_interval: float, half_life: float = HALF_LIFE) -> None:
        self.ping_interval = ping_interval
        self.half_life = half_life
        self.loads: dict[str, WorkerLoad] = {}
        self._at: float | None = None

    def sample(self, workers: Iterable[Sampled], now: float) -> dict[str, WorkerLoad]:
        """Fold in one look at `workers` (the live ones) taken at `now` (monotonic)."""
        elapsed = 0.0 if self._at is None else max(0.0, now - self._at)
        self._at = now
        keep = math.exp(-math.log(2) * elapsed / self.half_life)
        seen: dict[str, WorkerLoad] = {}
        for worker in workers:
            load = self.loads.get(worker.owner) or WorkerLoad(worker.owner, worker.slot)
            waited = max(0.0, worker.silent_for - self.ping_interval)
            load.lag = max(worker.ping_seconds or 0.0, waited, worker.loop_lag_seconds)
            if load.samples == 0:
                load.busy = float(worker.in_flight)
                load.lag_peak = load.lag
            else:
                load.busy = keep * load.busy + (1 - keep) * worker.in_flight
                load.lag_peak = max(load.lag, keep * load.lag_peak)
                if elapsed > 0:
                    arrived = max(0, worker.served - load.served) / elapsed
                    load.rate = keep * load.rate + (1 - keep) * arrived
            load.served = worker.served
            load.taking = worker.taking
            load.samples += 1
            seen[worker.owner] = load
        self.loads = seen  # a worker gone is forgotten; a new one starts afresh
        return seen
