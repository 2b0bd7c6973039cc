"""Handing running `/run` episodes over from a worker an operation empties to others.

An episode's client keeps its one HTTP request open; the request moves with the
episode (`worker.handovers` has the worker's side). For the episodes of one source:

1. hold: new requests of the sessions that ride along (the episode's request's session,
   the worker's sessions bound to the episode) wait at the proxy, and the move waits
   until only the episode's own request of them is running;
2. `park_episodes` on the source: each episode parks at its next boundary (a replay
   step in progress ends first) and the source answers its record and its riders'
   records; one that does not park by the deadline goes on running there, and is
   reported;
3. `move_in` on its target: it installs the riders and receives the episode's record,
   all or none (the record waits there as an arrival for the request);
4. the proxy expects each episode's request back from the source, under a fresh id;
5. `give_up` on the source: it answers each request with the marker and that id; the
   proxy sends the request, byte for byte, to the target (`proxy.data_path.exchange`, HANDOVER),
   whose admission takes the arrival and continues the episode from its boundary;
6. the session table sends the riders to the target and the held requests go on.

A failure before step 5 leaves each episode where it was, running (`resume_episodes`),
and the target forgets what it took. From step 5 on, an episode is in one place only:
the source gave its request back, or answered it itself (then the target forgets the
arrival). One whose given-back request does not reach the target (its client left, the
target died) is reported, with the reason; the client of a dead target sees the 502 or
410 it would have seen had the episode been running there.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gym_proxy.coordinator.broadcast import channel_of
from gym_proxy.coordinator.contract import failpoints
from gym_proxy.coordinator.contract.channel import ChannelClosed, ChannelTimeout, RemoteError
from gym_proxy.coordinator.contract.episodes import episode_key
from gym_proxy.coordinator.contract.messages import (
    EPISODE_ENDED,
    GaveUp,
    GiveUp,
    MoveIn,
    ParkedEpisodes,
    ParkEpisodes,
    ResumeEpisodes,
    RunningEpisode,
)

if TYPE_CHECKING:
    from gym_proxy.proxy.fleet.moves.mover import Moved, Mover, _Worker

__all__ = ["hand_over", "ARRIVAL_WAIT"]

log = logging.getLogger("gym_proxy.moves")

ARRIVAL_WAIT = 10.0  # seconds a given-back request gets to reach its target
RECEIVE_WAIT = 5.0  # seconds a target gets at least to receive parked episodes
GIVE_UP_WAIT = 20.0  # seconds the source gets to answer give_up (it waits 10 for the app)
_CHANNEL_ERRORS = (ChannelClosed, ChannelTimeout, RemoteError)


async def hand_over(
    mover: Mover,
    source: _Worker,
    episodes: Sequence[RunningEpisode],
    targets: Sequence[_Worker],
    deadline: float,
    result: Moved,
) -> None:
    """Hand `episodes` (running on `source`) over to `targets`, by the steps of the module
    docstring; `result` gets each episode key and the owner it went to, or why not. The
    caller excludes checkpoints and other moves."""
    movable = []
    for episode in episodes:
        if episode.unmovable:
            result.failed[episode.key] = episode.unmovable
        elif not targets:
            result.failed[episode.key] = "no worker to hand it over to"
        else:
            movable.append(episode)
    if not movable:
        return
    target_of = {e.key: targets[i % len(targets)] for i, e in enumerate(movable)}
    own = {e.key: e for e in movable}
    held = sorted({s for e in movable for s in _riders(e)})
    mover.table.hold_sessions(held)
    mover.holding += len(held)
    given_up: list[str] = []
    try:
        for key in await _busy_riders(mover, movable, deadline):
            result.failed[key] = "a request of a session it carries was still running"
            del own[key]
        if not own:
            return
        parked = await _park(source, list(own), deadline, result)
        if parked is None:
            return
        received = await _move_in(mover, source, parked, own, target_of, deadline, result)
        if received:
            given_up = received
            await _give_up(mover, source, received, parked, own, target_of, result)
    finally:
        mover.table.release_sessions(held)
        mover.holding -= len(held)
        # Whatever was not given up goes on where it is (parked by this call or before).
        _resume_later(source, [key for key in own if key not in given_up])


def _riders(episode: RunningEpisode) -> list[str]:
    """The worker's sessions that move with an episode: its request's (when the worker
    keeps it: a session minted for the `/run` alone has no state, and a later request
    of it routes to the source's heir), and those bound to the episode."""
    return list(episode.sessions)


async def _busy_riders(mover: Mover, movable: list[RunningEpisode], deadline: float) -> list[str]:
    """Step 1's wait, until of each episode's riders' requests only its own still runs
    (or `deadline`); answers the episodes whose riders are still busy then."""
    own_requests: dict[str, int] = {}
    for episode in movable:
        if episode.session_id is not None:
            own_requests[episode.session_id] = own_requests.get(episode.session_id, 0) + 1
    running = mover.table.running_requests

    def busy() -> dict[str, list[str]]:
        """Each episode still waiting, with its riders that run another request."""
        waiting = {}
        for e in movable:
            riders = [s for s in _riders(e) if running(s) > own_requests.get(s, 0)]
            if riders:
                waiting[e.key] = riders
        return waiting

    while True:
        still = busy()
        if not still or time.monotonic() >= deadline or mover.exclusion.giving_way:
            return list(still)
        riders = [s for waiting in still.values() for s in waiting]
        await mover.table.until_a_request_ends(riders, deadline, mover.exclusion.asked)


async def _park(
    source: _Worker, keys: list[str], deadline: float, result: Moved
) -> ParkedEpisodes | None:
    """Step 2."""
    within = max(0.1, deadline - time.monotonic())
    try:
        parked = await channel_of(source).request(ParkEpisodes(keys, within), within=within + 5.0)
    except _CHANNEL_ERRORS as exc:
        for key in keys:
            result.failed[key] = f"worker {source.slot} did not park it: {exc}"
        return None
    result.failed.update({k: why for k, why in parked.not_parked.items() if why != EPISODE_ENDED})
    return parked


async def _move_in(
    mover: Mover,
    source: _Worker,
    parked: ParkedEpisodes,
    own: dict[str, RunningEpisode],
    target_of: dict[str, _Worker],
    deadline: float,
    result: Moved,
) -> list[str]:
    """Step 3, per target; answers the keys of the episodes their targets received."""
    rider_of = {s: key for key, e in own.items() for s in _riders(e)}
    by_target: dict[int, tuple[_Worker, list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for record in parked.episodes:
        target = target_of[_key(record)]
        by_target.setdefault(id(target), (target, [], []))[1].append(record)
    for record in parked.sessions:
        target = target_of[rider_of[record["session_id"]]]
        by_target.setdefault(id(target), (target, [], []))[2].append(record)
    failpoints.hit("handover-before-receive")
    # The episodes wait parked meanwhile: the deadline bounded the wait for boundaries.
    within = max(RECEIVE_WAIT, deadline - time.monotonic())

    async def receive(
        target: _Worker, episodes: list[dict[str, Any]], sessions: list[dict[str, Any]]
    ) -> list[str]:
        keys = [_key(r) for r in episodes]
        try:
            await channel_of(target).request(MoveIn(sessions, episodes), within=within)
        except _CHANNEL_ERRORS as exc:
            for key in keys:
                result.failed[key] = f"worker {target.slot} did not take it: {exc}"
            mover.drop_later(target, [r["session_id"] for r in sessions], keys)
            return []
        return keys

    taken = await asyncio.gather(*(receive(*entry) for entry in by_target.values()))
    return [key for keys in taken for key in keys]


async def _give_up(
    mover: Mover,
    source: _Worker,
    keys: list[str],
    parked: ParkedEpisodes,
    own: dict[str, RunningEpisode],
    target_of: dict[str, _Worker],
    result: Moved,
) -> None:
    """Steps 4-6."""
    table = mover.table
    ids = {key: secrets.token_hex(16) for key in keys}
    arrivals = {
        key: table.expect_handover(ids[key], source.owner, target_of[key].owner) for key in keys
    }
    gave: GaveUp | None = None
    try:
        gave = await channel_of(source).request(GiveUp(ids), within=GIVE_UP_WAIT)
    except _CHANNEL_ERRORS as exc:
        log.warning("worker %d did not say which episodes it gave up: %s", source.slot, exc)
    failpoints.hit("handover-given-up")
    # What the source gave back is on its way; without its word, each arrival tells.
    coming = [arrivals[k] for k in keys if gave is None or k in gave.handed]
    if coming:
        await asyncio.wait(coming, timeout=ARRIVAL_WAIT)
    for key in keys:
        target, arrival = target_of[key], arrivals[key]
        why = arrival.result() if arrival.done() else None
        table.forget_handover(ids[key])
        if gave is not None and key not in gave.handed:
            why_kept = gave.kept.get(key, EPISODE_ENDED)
            if why_kept != EPISODE_ENDED:
                result.failed[key] = f"worker {source.slot} kept it: {why_kept}"
            mover.drop_later(target, list(own[key].sessions), [key])
            continue
        if why is None and gave is None:
            # The source never said: it may still hold the episode. Its sessions stay.
            result.failed[key] = f"worker {source.slot} did not give it up in time"
            mover.drop_later(target, list(own[key].sessions), [key])
            continue
        # Given up: the source ended its riders; the target holds them now.
        for session_id in _riders(own[key]):
            table.place_session(session_id, target.owner, kept=True)
            for linked in parked.links.get(session_id, ()):
                table.place_session(linked, target.owner, kept=False)
        if why:
            result.failed[key] = f"its request did not reach worker {target.slot}: {why}"
            mover.drop_later(target, [], [key])
        elif why is None:
            result.failed[key] = f"its request did not reach worker {target.slot} in time"
            mover.drop_later(target, [], [key])
        else:
            result.moved[key] = target.owner


def _resume_later(source: _Worker, keys: list[str]) -> None:
    if not keys:
        return

    async def resume() -> None:
        try:
            await channel_of(source).request(ResumeEpisodes(keys), within=30.0)
        except _CHANNEL_ERRORS as exc:
            log.warning("worker %d did not resume %d episodes: %s", source.slot, len(keys), exc)

    task = asyncio.ensure_future(resume())
    _RESUMES.add(task)
    task.add_done_callback(_RESUMES.discard)


_RESUMES: set[asyncio.Future[None]] = set()


def _key(record: dict[str, Any]) -> str:
    identity = record["episode_id"]
    return episode_key(identity["rollout_id"], identity["attempt"])
