"""The sessions that moved away from this worker: a request for one is refused here.

A move installs a session on its target, then the source drops it; the proxy's session
table sends the session's requests to the target from then on, while its token still
names the source. A gym-proxy that adopts the workers after a crash or a take-over knows
only the sessions the workers hold: if the target is gone by then (killed, say), the
token routes the session back to the source, which no longer has its state. Serving it
there would start it over in silence, so the source remembers what it dropped and
answers such a request 410 `session_owner_gone`, as the proxy did before it died.

A session installed here again (moved back, restored) is served again. The memory is
bounded: at most MAX_KEPT sessions (the oldest forgotten first), and, with
`--session-idle-ttl`, none longer than the session itself would have lived idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

__all__ = ["MovedAway", "MAX_KEPT"]

MAX_KEPT = 1_000_000  # sessions remembered (about 100 MB at worst)


class MovedAway:
    """Session keys (as the worker's store keys them) that moved away, with when."""

    def __init__(self, idle_ttl: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_ttl = idle_ttl
        self._clock = clock
        self._since: dict[str, float] = {}  # oldest first

    def __contains__(self, key: object) -> bool:
        return key in self._since

    def __len__(self) -> int:
        return len(self._since)

    def add(self, keys: Iterable[str]) -> None:
        now = self._clock()
        for key in keys:
            self._since.pop(key, None)  # moved away again: its time is now
            self._since[key] = now
        self._prune(now)

    def discard(self, keys: Iterable[str]) -> None:
        """These sessions are here again."""
        for key in keys:
            self._since.pop(key, None)

    def _prune(self, now: float) -> None:
        since = self._since
        while len(since) > MAX_KEPT:
            del since[next(iter(since))]
        if self.idle_ttl > 0:
            while since:
                oldest = next(iter(since))
                if now - since[oldest] <= self.idle_ttl:
                    break
                del since[oldest]
