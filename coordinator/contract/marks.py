"""Retire marks and restored claims: the two rules about attempts, written once (pure).

**Retire marks.** A controller retires attempts (`retire`); the mark of a rollout is the
highest attempt retired, and every attempt at or below it is retired: refused, its
requests cancelled, its state freed, until the controller `forget`s the rollout. Marks
only grow; the coordinator and every worker hold the same marks (a worker that joins
late gets them when it registers).

**Restored claims.** A restore holds each restored episode until exactly one worker
continues it: rollout -> (the attempt that continues it, what is held). The first
`/run` of that attempt claims it; any other attempt is `stale_attempt`; a retire mark
that covers the attempt drops the claim (the rollout starts over as a later attempt).
The coordinator holds the records, each worker the attempts only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gym_proxy.coordinator.contract.episodes import EpisodeId
from gym_proxy.coordinator.contract.errors import GymError

__all__ = ["RetireMarks", "RestoredClaims"]

T = TypeVar("T")


@dataclass
class RetireMarks:
    """rollout -> the highest retired attempt (module docstring)."""

    marks: dict[str, int] = field(default_factory=dict)

    def covers(self, episode: EpisodeId) -> bool:
        """Whether `episode` is retired: its attempt is at or below its rollout's mark."""
        mark = self.marks.get(episode.rollout_id)
        return mark is not None and episode.attempt <= mark

    def retire(self, episodes: Iterable[EpisodeId]) -> None:
        """Mark these attempts (and so every earlier one of their rollouts) retired."""
        for episode in episodes:
            self.marks[episode.rollout_id] = max(
                self.marks.get(episode.rollout_id, -1), episode.attempt
            )

    def merge(self, marks: Mapping[str, int]) -> None:
        """Take in marks held elsewhere (marks only grow)."""
        self.retire(EpisodeId(rollout_id, attempt) for rollout_id, attempt in marks.items())

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """Stop refusing these rollouts' retired attempts."""
        for rollout_id in rollout_ids:
            self.marks.pop(rollout_id, None)

    def as_dict(self) -> dict[str, int]:
        return dict(self.marks)

    def __len__(self) -> int:
        return len(self.marks)


@dataclass
class RestoredClaims(Generic[T]):
    """rollout -> (the attempt that continues it, what is held for it) (module docstring)."""

    held: dict[str, tuple[int, T]] = field(default_factory=dict)

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self.held

    def __len__(self) -> int:
        return len(self.held)

    def __iter__(self) -> Iterator[tuple[EpisodeId, T]]:
        """(the continuing attempt, what is held), for every unclaimed episode."""
        for rollout_id, (attempt, value) in list(self.held.items()):
            yield EpisodeId(rollout_id, attempt), value

    def check(self, episode: EpisodeId) -> T:
        """What is held for `episode`, if it is the attempt that continues its rollout;
        else GymError `stale_attempt` naming why."""
        held = self.held.get(episode.rollout_id)
        if held is None:
            detail = f"{episode.rollout_id} has no unclaimed restored record"
            raise GymError("stale_attempt", detail)
        if held[0] != episode.attempt:
            detail = f"{episode.rollout_id} continues only as attempt {held[0]}"
            raise GymError("stale_attempt", detail)
        return held[1]

    def take(self, rollout_id: str) -> None:
        """The episode was claimed (or is no longer held elsewhere): drop it."""
        self.held.pop(rollout_id, None)

    def drop_retired(self, marks: RetireMarks) -> list[EpisodeId]:
        """Drop the claims whose attempt `marks` cover; return them."""
        dropped = [episode for episode, _ in self if marks.covers(episode)]
        for episode in dropped:
            del self.held[episode.rollout_id]
        return dropped

    def keep_only(self, keys: set[str]) -> None:
        """Drop the claims whose continuing attempt's capture key is not in `keys`."""
        for episode, _ in self:
            if episode.key not in keys:
                del self.held[episode.rollout_id]

    def keys(self) -> list[str]:
        """The capture keys of the continuing attempts, sorted."""
        return sorted(episode.key for episode, _ in self)

    def attempts(self) -> dict[str, int]:
        """rollout -> the attempt that continues it (what a worker holds)."""
        return {rollout_id: attempt for rollout_id, (attempt, _) in self.held.items()}

    def clear(self) -> None:
        self.held.clear()
