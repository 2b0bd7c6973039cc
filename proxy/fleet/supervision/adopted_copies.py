"""Which adopted worker keeps a session two of them hold.

A move copies a session to its target and only then drops it on its source (`mover`), so
a gym-proxy that dies between the two leaves both workers holding it, and both name it
when a new gym-proxy adopts them. The copy to keep is the one used last: a copy is always
made from the newest state (the source serves no request of a moving session while it
is exported and installed), so whichever worker touched the session later holds a state
at least as new as the other's. The workers report when each session was last used or
installed on CLOCK_MONOTONIC (`time.monotonic()`), which every process of one machine
shares; the other copy is dropped.
"""

from __future__ import annotations

__all__ = ["AdoptedCopies"]


class AdoptedCopies:
    """Session -> (last use, owner) of the copy kept so far, while workers rejoin."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[float, str]] = {}

    def take(self, owner: str, held: dict[str, float]) -> tuple[list[str], dict[str, list[str]]]:
        """A rejoining worker's held sessions (session -> last use): the ones that route to
        it, and per owner the copies to drop (its own older ones, or another worker's)."""
        routed: list[str] = []
        stale: dict[str, list[str]] = {}
        kept = self._kept
        for session_id, used in held.items():
            earlier = kept.get(session_id)
            if earlier is not None:
                if earlier[0] >= used:
                    stale.setdefault(owner, []).append(session_id)
                    continue
                stale.setdefault(earlier[1], []).append(session_id)
            kept[session_id] = (used, owner)
            routed.append(session_id)
        return routed, stale

    def clear(self) -> None:
        """The adoption is over: later registrations are new workers."""
        self._kept.clear()
