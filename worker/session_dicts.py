"""Session state kept in a dict of the app's, keyed by its session IDs, declared instead of
written as hooks (`Participation(session_state=...)`, `gym-proxy --session-state ATTR`).

Many NeMo Gym resources servers keep their per-session state in such a dict
(`session_id_to_counter`, `session_id_to_state`, ...), keyed by NeMo Gym's session ID, the
one the runtime tracks for the app. The declaration turns it into the four hooks: export
reads each live session's entry, restore installs entries (all checked first, then all
written), retire and release drop them. That the values are JSON is checked where every
record is encoded (`coordinator.checkpoint_files.encode`): a value that is not fails the commit,
naming the session and the type, before anything is written.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from gym_proxy.worker.participation import ParticipantHooks

__all__ = ["session_dict_hooks"]


def session_dict_hooks(states: MutableMapping[str, Any]) -> ParticipantHooks:
    """Hooks that checkpoint `states[session_id]` for every session the runtime tracks."""

    async def export(session_ids: list[str]) -> dict[str, Any]:
        return {sid: states[sid] for sid in session_ids if sid in states}

    async def restore(restored: dict[str, Any]) -> None:
        bad = [sid for sid in restored if not isinstance(sid, str)]
        if bad:
            raise ValueError(f"session IDs must be strings, not {bad[:3]!r}")
        states.update(restored)

    async def retire(session_ids: list[str]) -> None:
        drop(session_ids)

    def drop(session_ids: list[str]) -> None:
        for sid in session_ids:
            states.pop(sid, None)

    return ParticipantHooks(export=export, restore=restore, retire=retire, release=drop)
