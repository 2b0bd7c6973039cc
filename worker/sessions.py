"""Per-session state a worker holds for its app, exported at commit, installed at restore.

Entries are kept in order of last use (a use moves an entry to the end), so sessions
idle longer than a TTL are found at the front and expired without a scan. Whatever ends
sessions (a closer, the TTL, a retire, a release after commit) tells `on_end`, so the
proxy can drop them from its routing table. Every change of which sessions are live or
what they are bound to (begun, bound, installed, ended; not a value, not a use) tells
`on_change`: a readiness report counts them (`worker.readiness`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

from gym_proxy.coordinator.contract.episodes import episode_key, parse_episode_key

__all__ = ["SessionEntry", "SessionStore", "session_record"]


def session_record(session_id: str, episode: str | None, state: Any, owner: str) -> dict[str, Any]:
    """NeMo Gym's resources session record (`episode_id` null: bound to no episode)."""
    return {
        "episode_id": None if episode is None else parse_episode_key(episode).as_json(),
        "session_id": session_id,
        "state": state,
        "owner": owner,
    }


@dataclass(slots=True)
class SessionEntry:
    """One session: its JSON-able value, the episode it is bound to, where it came from."""

    value: Any = None
    episode: str | None = None
    restored: bool = False
    used: float = field(default_factory=time.monotonic)


class SessionStore:
    """Session ID -> entry. Values must be JSON-able (orjson)."""

    def __init__(self) -> None:
        self._entries: dict[str, SessionEntry] = {}
        self.on_end: Callable[[list[str]], None] | None = None  # sessions that ended
        self.on_change: Callable[[], None] | None = None  # live sessions or bindings changed

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def last_used(self) -> dict[str, float]:
        """Every session with when it was last used or installed (a rejoining worker
        names them)."""
        return {session_id: entry.used for session_id, entry in self._entries.items()}

    def get(self, session_id: str, default: Any = None) -> Any:
        """The session's value, or `default` when it has none."""
        entry = self._entries.get(session_id)
        return default if entry is None or entry.value is None else entry.value

    def put(self, session_id: str, value: Any, episode: str | None = None) -> None:
        """Set the value; a session stays bound to the episode that created it."""
        entry = self._entries.get(session_id)
        if entry is None:
            self._entries[session_id] = SessionEntry(value, episode)
            self._changed()
        else:
            entry.value = value

    def touch(self, session_id: str, episode: str | None = None) -> None:
        """Record that a session is live and used now, even if the app keeps no value."""
        entry = self._entries.pop(session_id, None)
        begun = entry is None
        if entry is None:
            entry = SessionEntry(None, episode)
        else:
            entry.used = time.monotonic()
        self._entries[session_id] = entry
        if begun:
            self._changed()

    def expire(self, idle_before: float, busy: Container[str]) -> list[str]:
        """End sessions last used before `idle_before` (monotonic) unless `busy`."""
        doomed = []
        for session_id, entry in self._entries.items():
            if entry.used >= idle_before:
                break
            if session_id not in busy:
                doomed.append(session_id)
        for session_id in doomed:
            del self._entries[session_id]
        self._ended(doomed)
        return doomed

    def delete(self, session_id: str) -> bool:
        """End a session; True if it was live."""
        if self._entries.pop(session_id, None) is None:
            return False
        self._ended([session_id])
        return True

    def _ended(self, session_ids: list[str]) -> None:
        if session_ids and self.on_end is not None:
            self.on_end(session_ids)
        if session_ids:
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def bind(self, session_id: str, episode: str) -> None:
        """Bind a live session with no episode to `episode` (a seed sent under one)."""
        entry = self._entries.get(session_id)
        if entry is not None and entry.episode is None:
            entry.episode = episode
            self._changed()

    def bound_to(self, keys: set[str]) -> dict[str, str]:
        """The sessions bound to one of `keys`, with the key each is bound to."""
        return {
            sid: entry.episode
            for sid, entry in self._entries.items()
            if entry.episode is not None and entry.episode in keys
        }

    def unbound(self) -> int:
        """How many live sessions are bound to no episode."""
        return sum(1 for e in self._entries.values() if e.episode is None)

    def episodes(self) -> set[str]:
        """The episode keys live sessions are bound to."""
        return {e.episode for e in self._entries.values() if e.episode is not None}

    def sessions_in(self, scope: set[str] | None) -> dict[str, SessionEntry]:
        """Sessions unbound or bound to an episode in `scope` (None: all)."""
        return {
            sid: entry
            for sid, entry in self._entries.items()
            if entry.episode is None or scope is None or entry.episode in scope
        }

    def export(self, owner: str, scope: set[str] | None) -> list[dict[str, Any]]:
        """Records of every session unbound or bound to an episode in `scope` (None: all)."""
        return [
            session_record(session_id, entry.episode, entry.value, owner)
            for session_id, entry in self.sessions_in(scope).items()
        ]

    def install(self, records: list[dict[str, Any]], restored: bool = True) -> int:
        """Add restored sessions (their episode IDs already name the new attempt), or, not
        `restored`, live sessions moved here from another worker."""
        for record in records:
            bound = record["episode_id"]
            key = None if bound is None else episode_key(bound["rollout_id"], bound["attempt"])
            self._entries[record["session_id"]] = SessionEntry(record.get("state"), key, restored)
        if records:
            self._changed()
        return len(records)

    def session_ids(self) -> list[str]:
        """Every live session, least recently used first."""
        return list(self._entries)

    def entries(self, session_ids: list[str]) -> dict[str, SessionEntry]:
        """The entries of those of `session_ids` this store holds."""
        found = {}
        for session_id in session_ids:
            entry = self._entries.get(session_id)
            if entry is not None:
                found[session_id] = entry
        return found

    def uninstall(self) -> list[str]:
        """Drop every restored session (a restore that failed elsewhere)."""
        return self._drop(lambda e: e.restored)

    def release(self, keep: set[str]) -> list[str]:
        """Drop restored sessions bound to an episode outside `keep`."""
        return self._drop(lambda e: e.restored and e.episode is not None and e.episode not in keep)

    def release_episodes(self, keys: set[str]) -> list[str]:
        """Drop every session bound to one of `keys` (a retired attempt)."""
        return self._drop(lambda e: e.episode in keys)

    def _drop(self, doomed: Callable[[SessionEntry], bool]) -> list[str]:
        victims = [sid for sid, entry in self._entries.items() if doomed(entry)]
        for sid in victims:
            del self._entries[sid]
        self._ended(victims)
        return victims
