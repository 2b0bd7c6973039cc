"""What a checkpoint saved, and which rollouts it did not.

A participant that cannot capture its part of an episode (a restart-only server: one that
declares no state) names the episode in its prepare report's `restarts`. As in NeMo Gym's
coordination (`PrepareResult.continued`) and rollout collection (`collection.json`'s
`restarted`), such an episode is left out of the commit scope: it keeps running, but the
checkpoint holds nothing of it, so after a crash the controller must start it over from its
input. A rollout restarts if any one of its parts does. Stragglers a checkpoint retired
(`stragglers="retire"`) are not in it either, and were stopped: they start over at once, as
their next attempt (the retired one is refused until `forget`).

A `CheckpointResult` with restarts or retired stragglers is **partial**: it says so
(`complete`, `summary`), names every such rollout by participant, and never looks like
one that saved everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gym_proxy.coordinator.contract.answers import CommitAnswer
from gym_proxy.coordinator.contract.episodes import EpisodeId

__all__ = ["CheckpointResult", "episode_label"]


def episode_label(episode: EpisodeId) -> str:
    """`ROLLOUT_ID:ATTEMPT`, as gym-proxy-ctl's `--episode` takes it."""
    return f"{episode.rollout_id}:{episode.attempt}"


def _ordered(episodes: set[EpisodeId]) -> tuple[EpisodeId, ...]:
    return tuple(sorted(episodes, key=lambda e: (e.rollout_id, e.attempt)))


@dataclass(frozen=True)
class CheckpointResult:
    """A committed checkpoint, and the rollouts it does not hold.

    `committed`: each participant's commit reply, by URL. `restarts`: by participant URL
    (every participant, none omitted), the episodes its prepare report named as restarts.
    `retired`: the stragglers this checkpoint retired (attempt N; they start over as N+1).
    `checkpoint_id` is the ID committed: `<id>.r` after a straggler retire.
    """

    checkpoint_id: str
    committed: dict[str, CommitAnswer]
    restarts: dict[str, tuple[EpisodeId, ...]]
    retired: tuple[EpisodeId, ...] = ()

    @classmethod
    def of(
        cls,
        checkpoint_id: str,
        committed: dict[str, CommitAnswer],
        restarts: dict[str, set[EpisodeId]],
        retired: list[EpisodeId] | None = None,
    ) -> CheckpointResult:
        """A result with its episodes in a stable order (rollout ID, then attempt)."""
        return cls(
            checkpoint_id,
            committed,
            {url: _ordered(episodes) for url, episodes in sorted(restarts.items())},
            _ordered(set(retired or ())),
        )

    def restart_episodes(self) -> tuple[EpisodeId, ...]:
        """Every episode some participant named as a restart, once."""
        return _ordered({e for episodes in self.restarts.values() for e in episodes})

    @property
    def complete(self) -> bool:
        """True only if the checkpoint holds every episode in flight: no participant named
        a restart and no straggler was retired."""
        return not self.restart_episodes() and not self.retired

    def summary(self) -> str:
        """One line: what was committed, and (if partial) how many rollouts start over."""
        done = f"checkpoint {self.checkpoint_id} committed on {len(self.committed)} participant(s)"
        if self.complete:
            return f"{done}; complete"
        parts = []
        restarts = self.restart_episodes()
        if restarts:
            named_by = ", ".join(
                f"{url} ({len(episodes)})" for url, episodes in self.restarts.items() if episodes
            )
            parts.append(
                f"{len(restarts)} rollout(s) in flight are not in it: after a restore they "
                f"must start over from their input (restarts named by {named_by})"
            )
        if self.retired:
            parts.append(f"{len(self.retired)} straggler(s) were retired and must start over now")
        return f"{done}; partial: " + "; ".join(parts)

    def as_json(self) -> dict[str, Any]:
        """The machine-readable form gym-proxy-ctl prints; episodes as the control plane
        names them (`{"rollout_id", "attempt"}`)."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "complete": self.complete,
            "summary": self.summary(),
            "restart_count": len(self.restart_episodes()),
            "restarts": {
                url: [e.as_json() for e in episodes] for url, episodes in self.restarts.items()
            },
            "retired": [e.as_json() for e in self.retired],
            "committed": {url: answer.as_json() for url, answer in self.committed.items()},
        }
