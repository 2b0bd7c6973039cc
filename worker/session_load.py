"""What each session of a worker costs it lately: the loop's delay charged to it, and the
time its requests ran. The proxy's rebalance asks (`held`) before it sheds sessions, so
that it leaves the sessions that carry a hot worker's load where they are: moved, their
load would follow them, and make their new worker hot in turn.

- **delay**: each time the loop-lag sampler (`coordinator.contract.loop_lag`) wakes
  late, the lateness is charged, in equal parts, to the sessions whose requests were
  in the worker when it was due (admitted before, not yet gone): a handler that blocks
  the loop is one of them, while the requests that waited behind it were still in the
  socket, unread. A request that waits on something else all along (a model's answer)
  is charged too, but it is not idle while it runs either;
- **busy**: the seconds its requests ran, from admission to their end (those running now
  counted up to now).

Both decay with `HALF_LIFE` (the proxy's load average's, `proxy.fleet.balance.load`), so "lately"
means the same seconds on both sides. Keyed by the session as the store keys it, or the
gym-proxy session a request came under when it named no other (the proxy adds those of
an app session's links to it). Nothing here is timed per request but its admission and
its end; the sampler's own ten wake-ups a second do the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["SessionLoad", "HALF_LIFE"]

HALF_LIFE = 3.0  # seconds, as the proxy's load average
# Lateness under this is the timer's own grain (libuv counts milliseconds), not a loop
# something held: charged to nobody.
LATE_FLOOR = 0.002
FORGET_UNDER = 1e-4  # seconds: a session charged less than this is left out
# Requests gone between two wake-ups of the sampler, at most (it wakes ten times a
# second; a worker whose sampler does not run yet keeps no more than these).
GONE_AT_MOST = 4096


class Flight(Protocol):
    """A request in the worker (`worker.flights.InFlight`)."""

    admitted_at: float
    session_id: str | None
    key: str | None


def charged_to(flight: Flight) -> str | None:
    return flight.key or flight.session_id


@dataclass
class _Spent:
    delay: float = 0.0
    busy: float = 0.0
    at: float = 0.0  # when both were last brought up to date (monotonic)

    def decay(self, now: float) -> None:
        if now > self.at:
            keep = math.exp(-math.log(2) * (now - self.at) / HALF_LIFE)
            self.delay *= keep
            self.busy *= keep
            self.at = now


@dataclass(eq=False)
class SessionLoad:
    _spent: dict[str, _Spent] = field(default_factory=dict)
    # Requests gone since the sampler's last wake-up: (session, admitted at, gone at).
    _gone: list[tuple[str, float, float]] = field(default_factory=list)
    _prune_past: int = 256  # sessions kept before those charged next to nothing go

    def ended(self, flight: Flight, now: float) -> None:
        """A request ended: its running time is the session's."""
        key = charged_to(flight)
        if key is None:
            return
        self._spend(key, now).busy += now - flight.admitted_at
        if len(self._gone) < GONE_AT_MOST:
            self._gone.append((key, flight.admitted_at, now))
        if len(self._spent) > self._prune_past:  # amortized: ended sessions fade out
            self.recent(now, ())
            self._prune_past = 2 * len(self._spent) + 256

    def sampled(self, due: float, now: float, flights: Iterable[Flight]) -> None:
        """The sampler due at `due` woke at `now`: charge the lateness (see the module
        docstring)."""
        gone, self._gone = self._gone, []
        late = now - due
        if late < LATE_FLOOR:
            return
        there = {k for f in flights if f.admitted_at <= due and (k := charged_to(f)) is not None}
        there.update(key for key, admitted, ended in gone if admitted <= due < ended)
        for key in there:
            self._spend(key, now).delay += late / len(there)

    def recent(
        self, now: float, flights: Iterable[Flight]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Each session's recent delay and busy seconds (those running now counted up to
        now); sessions charged next to nothing are forgotten."""
        running: dict[str, float] = {}
        for flight in flights:
            key = charged_to(flight)
            if key is not None:
                running[key] = running.get(key, 0.0) + now - flight.admitted_at
        delay: dict[str, float] = {}
        busy: dict[str, float] = {}
        for key, spent in list(self._spent.items()):
            spent.decay(now)
            if spent.delay + spent.busy < FORGET_UNDER and key not in running:
                del self._spent[key]
                continue
            if spent.delay >= FORGET_UNDER:
                delay[key] = round(spent.delay, 6)
            if spent.busy >= FORGET_UNDER:
                busy[key] = round(spent.busy, 6)
        for key, seconds in running.items():
            busy[key] = round(busy.get(key, 0.0) + seconds, 6)
        return delay, busy

    def _spend(self, key: str, now: float) -> _Spent:
        spent = self._spent.get(key)
        if spent is None:
            spent = self._spent[key] = _Spent(at=now)
        else:
            spent.decay(now)
        return spent
