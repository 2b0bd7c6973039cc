"""Session state kept in a dict of the app's, keyed by its session IDs, declared instead of
written as hooks (`Participation(session_state=...)`, `gym-proxy --session-state ATTR`).

Many NeMo Gym resources servers keep their per-session state in such a dict
(`session_id_to_counter`, `session_id_to_state`, ...), keyed by NeMo Gym's session ID, the
one the runtime tracks for the app. `SessionDict` is the four hooks over it, which the
declaration (`worker.declaration`) hands the runtime: export reads each live session's
entry, restore installs entries (all checked first, then all written), retire and release
drop them. That the values are JSON is checked where every record is encoded
(`coordinator.contract.records.encode`): a value that is not fails the commit, naming the
session and the type, before anything is written.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

__all__ = ["SessionDict"]


class SessionDict:
    """The hooks that checkpoint `states[session_id]` for every session the runtime
    tracks (`ParticipantHooks`: export, restore, retire, and drop as its release)."""

    def __init__(self, states: MutableMapping[str, Any]) -> None:
        self.states = states

    async def export(self, session_ids: list[str]) -> dict[str, Any]:
        states = self.states
        return {sid: states[sid] for sid in session_ids if sid in states}

    async def restore(self, restored: dict[str, Any]) -> None:
        bad = [sid for sid in restored if not isinstance(sid, str)]
        if bad:
            raise ValueError(f"session IDs must be strings, not {bad[:3]!r}")
        self.states.update(restored)

    async def retire(self, session_ids: list[str]) -> None:
        self.drop(session_ids)

    def drop(self, session_ids: list[str]) -> None:
        for sid in session_ids:
            self.states.pop(sid, None)
