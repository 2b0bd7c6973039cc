"""A worker's state as records, out and in: what a commit exports (its sessions, its
parked `/run` episodes, the episodes handed over to it), what a restore installs, and
the sessions a move takes out, puts in and drops.

The state is the session store's (`worker.sessions`), or, for an app that keeps its
state elsewhere, what its hooks export and restore (`Participation.hooks`); a
restart-only app exports nothing and its sessions cannot move. Coordinator requests call
these (`worker.channel_requests`), and so do the episode hand-overs
(`worker.handovers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.records import encode
from gym_proxy.worker.sessions import SessionEntry, session_record

if TYPE_CHECKING:
    from gym_proxy.worker.runtime import ParticipantRuntime

__all__ = [
    "export",
    "install",
    "export_sessions",
    "session_records",
    "drop_sessions",
    "forget_sessions",
    "stop",
]


async def export(runtime: ParticipantRuntime, scope: set[str] | None) -> list[dict[str, Any]]:
    """Records of this worker's sessions and parked episodes within `scope`."""
    participation = runtime.participation
    if participation.restart_only:
        return []  # its episodes are restarts (report.restarts), never continued
    elif participation.hooks is not None and participation.hooks.export is not None:
        records = await _hook_records(runtime, runtime.store.sessions_in(scope))
    else:
        records = runtime.store.export(runtime.info.owner, scope)
    for flight in runtime.flights:
        ep = flight.episode
        if ep is not None and ep.exported and (scope is None or ep.key in scope):
            records.append(ep.export())
    # Handed over to this worker, its request not here yet: it is this worker's now.
    records += [r for key, r in runtime.arrivals.items() if scope is None or key in scope]
    return records


async def _hook_records(
    runtime: ParticipantRuntime, entries: dict[str, SessionEntry]
) -> list[dict[str, Any]]:
    """Records of these sessions with their state from the app's export hook (a
    session the hook does not answer for is left out)."""
    hooks = runtime.participation.hooks
    assert hooks is not None and hooks.export is not None
    states = await hooks.export(sorted(entries))
    owner = runtime.info.owner
    return [
        session_record(sid, entries[sid].episode, value, owner)
        for sid, value in states.items()
        if sid in entries
    ]


async def install(
    runtime: ParticipantRuntime, records: list[dict[str, Any]], restored: bool = True
) -> int:
    """Install restored sessions, or (not `restored`) live ones moved here: all or
    nothing (the hook raises to refuse)."""
    hooks = runtime.participation.hooks
    if hooks is not None and hooks.restore is not None:
        await hooks.restore({r["session_id"]: r.get("state") for r in records})
        records = [{**r, "state": None} for r in records]
    installed = runtime.store.install(records, restored)
    runtime.moved_away.discard(r["session_id"] for r in records)
    return installed


async def export_sessions(
    runtime: ParticipantRuntime, session_ids: list[str]
) -> list[dict[str, Any]]:
    """Records of those of `session_ids` this worker holds, for a move; it keeps them
    (and serves them) until told to drop them."""
    held = runtime.store.entries(session_ids)
    if not held:
        return []
    if runtime.participation.restart_only:
        raise GymError(
            "session_not_movable",
            "the app declares no session state (restart-only): its sessions cannot move",
        )
    busy = sorted({f.key for f in runtime.flights if f.key in held})
    if busy:
        raise GymError("session_not_movable", f"sessions with a request running: {busy}")
    return await session_records(runtime, held)


async def session_records(
    runtime: ParticipantRuntime, held: dict[str, SessionEntry]
) -> list[dict[str, Any]]:
    """The records of these live sessions, for a move (the store's values, or the
    app's export hook's)."""
    owner = runtime.info.owner
    hooks = runtime.participation.hooks
    if hooks is not None and hooks.export is not None:
        found = await _hook_records(runtime, held)
    else:
        found = [session_record(s, e.episode, e.value, owner) for s, e in held.items()]
    encode(found, runtime.kind)  # a state that is not JSON fails here, naming the session
    return found


async def drop_sessions(runtime: ParticipantRuntime, session_ids: list[str]) -> int:
    """These sessions moved away: end them here (the app's hooks free their state)."""
    dropped = [sid for sid in session_ids if runtime.store.delete(sid)]
    runtime.moved_away.add(dropped)
    return await forget_sessions(runtime, dropped)


async def forget_sessions(runtime: ParticipantRuntime, session_ids: list[str]) -> int:
    """The store dropped these sessions: tell the app's hook too (idempotent)."""
    hooks = runtime.participation.hooks
    if session_ids and hooks is not None and hooks.retire is not None:
        await hooks.retire(session_ids)
    return len(session_ids)


async def stop(runtime: ParticipantRuntime) -> None:
    """A commit with `stop: true` was written: free what the app can free."""
    hooks = runtime.participation.hooks
    if hooks is not None and hooks.stop is not None:
        await hooks.stop()
