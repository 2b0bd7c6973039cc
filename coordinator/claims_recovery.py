"""Restored episodes awaiting their replacement, carried across a gym-proxy crash.

A restore holds each restored episode's record until the `/run` that continues it claims
it (`contract/marks.py`, "Restored claims"); the records live in the coordinator, which
dies with gym-proxy. The checkpoint they came from is on disk, so a restore remembers
where (`restored.json` in the runtime directory: the checkpoint directory and the
restore's scope), and a gym-proxy that adopts the workers (`--orphan-grace`) reads those
records again. Which are still unclaimed, the workers say: each names the attempts it
still expects when it rejoins, and a claim drops the attempt on the worker that made it,
so an episode every rejoining worker still expects was claimed by none of them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from gym_proxy.coordinator.contract.marks import RestoredClaims, RetireMarks
from gym_proxy.coordinator.contract.state_files import load_document, replace_document

__all__ = ["RESTORED_NAME", "remember", "recall", "still_expected", "claims_from"]

log = logging.getLogger("gym_proxy.checkpoint")

RESTORED_NAME = "restored.json"


def remember(path: str, checkpoint_dir: str, scope: Iterable[str]) -> None:
    """Note the restore's checkpoint and scope at `path`, at once (old file or new)."""
    replace_document(path, {"checkpoint_dir": checkpoint_dir, "scope": sorted(scope)})


def recall(path: str) -> tuple[str, set[str]] | None:
    """The checkpoint directory and scope a dead instance restored; None when it did not
    (or its note is unreadable, which is logged)."""
    note = load_document(path, log, "restored episodes cannot be continued")
    if note is None:
        return None  # no restore to continue, or one line said why not
    directory = note.get("checkpoint_dir") if isinstance(note, dict) else None
    scope = note.get("scope") if isinstance(note, dict) else None
    if not isinstance(directory, str) or not isinstance(scope, list):
        log.warning("%s is not a restore's note: restored episodes cannot be continued", path)
        return None
    return directory, {key for key in scope if isinstance(key, str)}


def still_expected(expected: list[dict[str, int]]) -> dict[str, int]:
    """rollout -> attempt that every rejoining worker still expects (none rejoined: none)."""
    if not expected:
        return {}
    common = dict(expected[0])
    for attempts in expected[1:]:
        common = {r: a for r, a in common.items() if attempts.get(r) == a}
    return common


def claims_from(
    episodes: list[dict[str, Any]], expected: dict[str, int], marks: RetireMarks
) -> RestoredClaims[dict[str, Any]]:
    """The claims of the restored `episodes` (records of the checkpoint) whose continuing
    attempt is still `expected` and not retired."""
    claims: RestoredClaims[dict[str, Any]] = RestoredClaims()
    for record in episodes:
        rollout, attempt = record["episode_id"]["rollout_id"], record["episode_id"]["attempt"]
        if expected.get(rollout) == attempt + 1:
            claims.held[rollout] = (attempt + 1, record)
    claims.drop_retired(marks)
    return claims
