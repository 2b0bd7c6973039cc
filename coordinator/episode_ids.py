"""Episode identity shared by the coordinator, the control plane and the workers.

An episode is one rollout attempt `{rollout_id, attempt}`; its key is `rollout_id` for
attempt 0 and `rollout_id-a<N>` otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["EpisodeId", "episode_key", "parse_episode_key"]

_KEY = re.compile(r"(.+)-a([0-9]+)\Z")


@dataclass(frozen=True, slots=True)
class EpisodeId:
    rollout_id: str
    attempt: int

    @property
    def key(self) -> str:
        return episode_key(self.rollout_id, self.attempt)

    def next_attempt(self) -> EpisodeId:
        return EpisodeId(self.rollout_id, self.attempt + 1)

    def as_json(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}


def episode_key(rollout_id: str, attempt: int) -> str:
    """`rollout_id` for attempt 0, `rollout_id-a<N>` otherwise."""
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def parse_episode_key(key: str) -> EpisodeId:
    """The inverse of episode_key."""
    match = _KEY.match(key)
    if match is None:
        return EpisodeId(key, 0)
    return EpisodeId(match.group(1), int(match.group(2)))
