"""Episode identity and the episode context an app uses inside a long request.

An episode is one rollout attempt: `{rollout_id, attempt}`, keyed `rollout_id` for
attempt 0 and `rollout_id-a<N>` otherwise. Inside a long request the app calls
`await ep.boundary(state)` between steps; while a checkpoint is open the episode parks
there (its state is what commit exports). `await ep.replay(awaitable)` runs a step that
is safe to repeat: meanwhile the episode counts as parked at the boundary before it, and
if the checkpoint is still open when the step ends, the result waits until resume.

Only a `/run` episode is exported as an episode record (only a `/run` of attempt N+1
claims one after a restore). Any other request under rollout identity (a call sent as
`/ng-rollout/<key>/...`, such as an agent's turn) parks and replays the same way, but
keeps its progress in its session, which is exported bound to the episode.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from gym_proxy.coordinator.contract.episodes import EpisodeId, episode_key, parse_episode_key

if TYPE_CHECKING:
    from gym_proxy.worker.flights import InFlight
    from gym_proxy.worker.runtime import ParticipantRuntime

__all__ = ["EpisodeId", "Episode", "episode_key", "parse_episode_key"]

T = TypeVar("T")


class Episode:
    """The context of one episode inside its long request."""

    def __init__(
        self,
        runtime: ParticipantRuntime,
        flight: InFlight,
        identity: EpisodeId,
        restored: bool,
        restored_state: Any,
        task_digest: str = "",
        exported: bool = True,
    ) -> None:
        self._runtime = runtime
        self._flight = flight
        self.identity = identity
        self.restored = restored
        self.restored_state = restored_state
        self.task_digest = task_digest
        self.exported = exported  # a /run episode: its record is exported at commit
        self.state: Any = restored_state
        self.parked_seconds = 0.0

    @property
    def key(self) -> str:
        return self.identity.key

    async def boundary(self, state: Any) -> None:
        """A point between steps: record `state` (JSON-able); park here while closed."""
        self.state = state
        self.parked_seconds += await self._runtime.park(self._flight, "parked")

    async def replay(self, step: Awaitable[T]) -> T:
        """Run a repeatable step; the episode stays parked at its last boundary meanwhile.
        Its outcome, a result or an exception, waits while parked (a checkpoint open, a
        hand-over under way), so the app runs nothing past the boundary meanwhile."""
        self._runtime.set_position(self._flight, "replay")
        try:
            result = await step
        except Exception:
            self._runtime.set_position(self._flight, "running")
            self.parked_seconds += await self._runtime.park(self._flight, "parked")
            raise
        except BaseException:  # cancelled: it leaves
            self._runtime.set_position(self._flight, "running")
            raise
        self._runtime.set_position(self._flight, "running")
        self.parked_seconds += await self._runtime.park(self._flight, "parked")
        return result

    def export(self) -> dict[str, Any]:
        """NeMo Gym's environment record: the episode at its latest boundary."""
        return {
            "episode_id": self.identity.as_json(),
            "task_digest": self.task_digest,
            "boundary": self.state,
        }
