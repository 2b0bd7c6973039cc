"""Handing a parked `/run` episode over to another worker while its client waits.

On the source, in three calls from the coordinator's mover:

1. `park_episodes`: each named episode parks at its next boundary, as at a checkpoint
   but alone: the worker serves on. Unlike a checkpoint, a replay step in progress is
   not a boundary here: the step's callee (another server) is not parked with it, so
   repeating the step now would run it twice at once; the episode parks as the step
   ends (the step then runs again on the target, as after a restore). Its record
   (`Episode.export`) is answered with the records of the sessions that ride along: its
   request's session and the sessions bound to the episode;
2. `give_up`: its task is cancelled where it waits, and the front door answers its
   request with the hand-over marker (`HANDOVER_STATUS`, the `x-ng-handover` id, and the
   request's own body); the proxy sends the request, unchanged, to the target. The
   sessions that rode along end here;
3. or `resume_episodes`: the hand-over was given up, and the episodes go on here.

On the target, `move_in` receives each record among the runtime's *arrivals*; admission of the
replayed request takes it, as it takes a restored claim but for the same attempt, and the
app continues from `ep.restored_state`. Until then the arrival is this worker's: a
checkpoint exports it and a retire of its attempt drops it.

Exactly once: after parking for a hand-over the source never runs the episode on unless
the hand-over is given up, and the target runs it only from the replayed request, which
exists only if the source answered with the marker. An app that swallows the
cancellation and answers anyway is answered to its client and reported kept; the mover
then tells the target to forget the arrival.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gym_proxy.coordinator.contract.episodes import EpisodeId
from gym_proxy.coordinator.contract.messages import (
    EPISODE_ENDED,
    GaveUp,
    ParkedEpisodes,
    RunningEpisode,
)
from gym_proxy.worker import state_records

if TYPE_CHECKING:
    from gym_proxy.worker.flights import InFlight
    from gym_proxy.worker.runtime import ParticipantRuntime

__all__ = [
    "EpisodeHandover",
    "hands_over",
    "running_episodes",
    "park_episodes",
    "give_up",
    "resume_episodes",
    "receive_episodes",
]

GIVE_UP_WAIT = 10.0  # seconds a cancelled episode gets to leave the app


@dataclass(eq=False, slots=True)
class EpisodeHandover:
    """A hand-over of one request's episode, under way."""

    parked: asyncio.Event = field(default_factory=asyncio.Event)  # at a boundary, held
    go_on: asyncio.Event = field(default_factory=asyncio.Event)  # given up: run on here
    id: str | None = None  # set by give_up: the front door answers with the marker
    sent: bool = False  # the front door sent the marker


def _episode_flights(runtime: ParticipantRuntime) -> dict[str, InFlight]:
    return {
        f.episode.key: f
        for f in runtime.flights
        if f.episode is not None and f.episode.exported and f.task is not None
    }


def _riders(runtime: ParticipantRuntime, flight: InFlight) -> set[str]:
    """The worker's sessions that move with the flight's episode."""
    store = runtime.store
    assert flight.identity is not None
    riders = set(store.bound_to({flight.identity.key}))
    if flight.key is not None and flight.key in store:
        riders.add(flight.key)
    return riders


def hands_over(runtime: ParticipantRuntime) -> bool:
    """Whether this app's episodes can be handed over at all (a front door keeps a
    `/run`'s body for that only then)."""
    participation = runtime.participation
    return not participation.restart_only and participation.episode_boundaries


def _unmovable(runtime: ParticipantRuntime, flight: InFlight) -> str:
    """Why the flight's episode cannot be handed over ("" when it can)."""
    if runtime.participation.restart_only:
        return "the app declares no session state (restart-only): its episodes run where they are"
    if not runtime.participation.episode_boundaries:
        return "the app marks no episode boundaries: its episodes run where they are"
    if flight.responding:
        return "its answer has begun"
    if not flight.replayable:
        return "its request body came content-encoded (it cannot be sent on as it came)"
    if flight.handover is not None and flight.handover.id is not None:
        return "it is being given up"
    return ""


def running_episodes(runtime: ParticipantRuntime) -> list[RunningEpisode]:
    """The `/run` episodes running here, as an operation that empties the worker sees."""
    return [
        RunningEpisode(key, f.session_id, sorted(_riders(runtime, f)), _unmovable(runtime, f))
        for key, f in sorted(_episode_flights(runtime).items())
    ]


async def park_episodes(
    runtime: ParticipantRuntime, keys: list[str], within: float
) -> ParkedEpisodes:
    """Step 1 (module docstring): park these episodes, within `within` seconds, and answer
    the records of those that parked (an episode parked before answers at once)."""
    running = _episode_flights(runtime)
    not_parked: dict[str, str] = {}
    parking: dict[str, InFlight] = {}
    for key in dict.fromkeys(keys):
        flight = running.get(key)
        why = EPISODE_ENDED if flight is None else _unmovable(runtime, flight)
        if why:
            not_parked[key] = why
            continue
        assert flight is not None
        if flight.handover is None:  # else parked already: asked again, it answers again
            flight.handover = EpisodeHandover()
        parking[key] = flight
    waits = [asyncio.ensure_future(_parked_or_gone(f)) for f in parking.values()]
    if waits:
        await asyncio.wait(waits, timeout=within)
        for wait in waits:
            wait.cancel()
    for key, flight in list(parking.items()):
        handover = flight.handover
        if flight not in runtime.flights:
            not_parked[key] = EPISODE_ENDED
        elif handover is None or not handover.parked.is_set():
            not_parked[key] = "it did not reach a boundary in time"
        elif any(f is not flight and f.key in _riders(runtime, flight) for f in runtime.flights):
            not_parked[key] = "another request of its session is running"
        else:
            continue
        _go_on(flight)
        del parking[key]
    riders: set[str] = set()
    for flight in parking.values():
        riders |= _riders(runtime, flight)
    try:
        held = runtime.store.entries(sorted(riders))
        sessions = await state_records.session_records(runtime, held)
    except BaseException:
        for flight in parking.values():
            _go_on(flight)
        raise
    links = {s: sorted(runtime.links[s]) for s in sorted(riders) if s in runtime.links}
    episodes = [f.episode.export() for f in parking.values()]  # type: ignore[union-attr]
    return ParkedEpisodes(episodes, sessions, links, not_parked)


async def _parked_or_gone(flight: InFlight) -> None:
    """Until the flight parked for its hand-over, or its request ended (answered)."""
    assert flight.handover is not None and flight.task is not None
    parked = asyncio.ensure_future(flight.handover.parked.wait())
    try:
        await asyncio.wait([parked, flight.task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        parked.cancel()


async def give_up(runtime: ParticipantRuntime, handovers: dict[str, str]) -> GaveUp:
    """Step 2 (module docstring): stop these parked episodes; their requests are answered
    with the marker carrying each one's hand-over id."""
    running = _episode_flights(runtime)
    kept: dict[str, str] = {}
    stopping: dict[str, InFlight] = {}
    for key, handover_id in handovers.items():
        flight = running.get(key)
        handover = None if flight is None else flight.handover
        if flight is None or handover is None or not handover.parked.is_set():
            kept[key] = EPISODE_ENDED
            continue
        handover.id = handover_id
        flight.task.cancel()  # type: ignore[union-attr]
        stopping[key] = flight
    tasks = [f.task for f in stopping.values() if f.task is not None]
    if tasks:
        await asyncio.wait(tasks, timeout=GIVE_UP_WAIT)
    handed: list[str] = []
    riders: set[str] = set()
    for key, flight in stopping.items():
        if flight.handover is not None and flight.handover.sent:
            handed.append(key)
            riders |= _riders(runtime, flight)
        elif flight in runtime.flights:
            kept[key] = "it did not stop within its give-up wait"
        else:
            kept[key] = EPISODE_ENDED  # the app answered its request itself
    await state_records.drop_sessions(runtime, sorted(riders))
    return GaveUp(sorted(handed), kept)


def resume_episodes(runtime: ParticipantRuntime, keys: list[str]) -> None:
    """Step 3 (module docstring): these episodes go on here."""
    running = _episode_flights(runtime)
    for key in keys:
        flight = running.get(key)
        if flight is not None and flight.handover is not None and flight.handover.id is None:
            _go_on(flight)


def _go_on(flight: InFlight) -> None:
    handover, flight.handover = flight.handover, None
    if handover is not None:
        handover.go_on.set()


def receive_episodes(runtime: ParticipantRuntime, records: list[dict[str, Any]]) -> None:
    """On the target: each record waits for its replayed request (module docstring)."""
    for record in records:
        identity = record["episode_id"]
        runtime.arrivals[EpisodeId(identity["rollout_id"], identity["attempt"]).key] = record
