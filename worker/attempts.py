"""Rollout attempts in a worker: a restored episode claimed by the attempt that continues
it, and retired attempts, whose requests are stopped and whose later calls are refused.

After a restore, every worker holds the restored rollouts not yet claimed (rollout ->
the attempt that continues it: `ParticipantRuntime.claims`); the first `/run` of that
attempt asks the coordinator for the episode's record (`claim`), wherever it runs. A
retire (NeMo Gym's) marks the attempts and the earlier ones of their rollouts
(`ParticipantRuntime.marks`): their requests are cancelled, their sessions freed, and
their calls refused (`stale_attempt`) until the controller forgets the rollout.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from gym_proxy.coordinator.contract.channel import ChannelClosed, ChannelTimeout, RemoteError
from gym_proxy.coordinator.contract.episodes import EpisodeId, parse_episode_key
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.messages import Claim
from gym_proxy.worker.state_records import forget_sessions

if TYPE_CHECKING:
    from gym_proxy.worker.runtime import ParticipantRuntime

__all__ = ["claim", "retire", "forget", "CLAIM_WAIT"]

CLAIM_WAIT = 30.0


async def claim(runtime: ParticipantRuntime, identity: EpisodeId, digest: str) -> Any:
    """The restored episode this attempt continues: its boundary state, from the
    coordinator (GymError when refused or unanswered)."""
    runtime.claims.check(identity)
    assert runtime.channel is not None
    try:
        request = Claim(identity.rollout_id, identity.attempt, digest)
        reply = await runtime.channel.request(request, within=CLAIM_WAIT)
    except (ChannelClosed, ChannelTimeout) as exc:
        raise GymError(
            "checkpoint_coordinator_unavailable", f"the claim got no answer: {exc}"
        ) from exc
    except RemoteError as exc:
        if exc.code == "stale_attempt":
            # The coordinator no longer holds it (claimed elsewhere, retired); a parked
            # claim or a replacement of another task leaves the record where it is.
            runtime.claims.take(identity.rollout_id)
        raise GymError(exc.code, exc.detail) from exc
    runtime.claims.take(identity.rollout_id)
    return reply.boundary


async def retire(runtime: ParticipantRuntime, episode_ids: list[EpisodeId]) -> int:
    """Mark the attempts (and earlier ones of their rollouts) retired, cancel their
    requests, wait for them to stop, then free their sessions; return what was freed.
    The marks stay, whether or not this finishes, until `forget`."""
    runtime.marks.retire(episode_ids)
    covered = runtime.marks.covers
    doomed = [f for f in runtime.flights if f.identity is not None and covered(f.identity)]
    for flight in doomed:
        flight.retired = True
        if flight.task is not None:
            flight.task.cancel()
    tasks = [f.task for f in doomed if f.task is not None]
    if tasks:
        await asyncio.wait(tasks)
    store = runtime.store
    keys = {key for key in store.episodes() if covered(parse_episode_key(key))}
    for session_id, key in store.bound_to(keys).items():
        runtime.retired_sessions[session_id] = parse_episode_key(key).rollout_id
    freed = store.release_episodes(keys)
    runtime.claims.drop_retired(runtime.marks)
    for key in [k for k in runtime.arrivals if covered(parse_episode_key(k))]:
        del runtime.arrivals[key]
    return await forget_sessions(runtime, freed) + len(doomed)


def forget(runtime: ParticipantRuntime, rollout_ids: list[str]) -> list[str]:
    """Stop refusing these rollouts' retired attempts and sessions."""
    gone = set(rollout_ids)
    runtime.marks.forget(gone)
    for session_id, rollout_id in list(runtime.retired_sessions.items()):
        if rollout_id in gone:
            del runtime.retired_sessions[session_id]
    return sorted(gone)
