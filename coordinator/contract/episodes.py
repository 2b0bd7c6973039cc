"""Episode identity shared by the coordinator, the control plane and the workers.

An episode is one rollout attempt `{rollout_id, attempt}`; its key is `rollout_id` for
attempt 0 and `rollout_id-a<N>` otherwise.

NeMo Gym names a request's rollout in a `/run` or `/seed_session` body: by
`_ng_rollout_id`, else by 0.7.0's `_ng_task_index` and `_ng_rollout_index` (rollout
`"<task>-<rollout>"`, as NeMo Gym's `rollout_correlation` derives it), with
`_ng_attempt_index`; `body_identity` reads it, and `task_digest` is NeMo Gym's digest of
the task the body carries (the body without `_ng_*` fields).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import orjson

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.ids import MAX_ROLLOUT_ID, is_rollout_id

__all__ = [
    "EpisodeId",
    "episode_key",
    "parse_episode_key",
    "body_identity",
    "task_digest",
    "is_index",
    "check_rollout_id",
    "check_rollout_ids",
]

_KEY = re.compile(r"(.+)-a([0-9]+)\Z")
_ATTEMPT_SUFFIX = re.compile(r"-a[0-9]+\Z")
# ROLLOUT_ID and MAX_ROLLOUT_ID over many IDs at once, each ended by a newline (which no
# rollout ID holds): one regex pass instead of two calls an ID.
_ROLLOUT_LINES = re.compile(rf"(?:[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_ROLLOUT_ID - 1}}}\n)*\Z")
_ATTEMPT_SUFFIX_LINE = re.compile(r"-a[0-9]+\n")


@dataclass(frozen=True, slots=True)
class EpisodeId:
    rollout_id: str
    attempt: int

    @property
    def key(self) -> str:
        return episode_key(self.rollout_id, self.attempt)

    def next_attempt(self) -> EpisodeId:
        return EpisodeId(self.rollout_id, self.attempt + 1)

    def as_json(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}


def episode_key(rollout_id: str, attempt: int) -> str:
    """`rollout_id` for attempt 0, `rollout_id-a<N>` otherwise."""
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def check_rollout_ids(values: list[Any]) -> list[str]:
    """check_rollout_id of every value, in one pass when all are right (a control call
    names thousands); the first wrong one is named as check_rollout_id names it."""
    if all(type(v) is str for v in values):
        lines = "\n".join(values) + "\n" if values else ""
        whole = lines.count("\n") == len(values)  # no value held a newline of its own
        if whole and _ROLLOUT_LINES.match(lines) and not _ATTEMPT_SUFFIX_LINE.search(lines):
            return values
    return [check_rollout_id(v) for v in values]


def parse_episode_key(key: str) -> EpisodeId:
    """The inverse of episode_key."""
    match = _KEY.match(key)
    if match is None:
        return EpisodeId(key, 0)
    return EpisodeId(match.group(1), int(match.group(2)))


def body_identity(raw: bytes) -> tuple[EpisodeId | None, str]:
    """Rollout identity from a `/run` or `/seed_session` body (module docstring), and the
    digest of its task (the body without `_ng_*` fields)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, ""
    if not isinstance(body, dict):
        return None, ""
    rollout_id = body.get("_ng_rollout_id")
    if rollout_id is None:
        task, rollout = body.get("_ng_task_index"), body.get("_ng_rollout_index")
        if not (is_index(task) and is_index(rollout)):
            return None, ""
        rollout_id = f"{task}-{rollout}"
    elif not is_rollout_id(rollout_id):
        # As NeMo Gym does: a malformed explicit ID is refused, never rewritten.
        raise GymError("invalid_request", f"_ng_rollout_id {rollout_id!r} is not a rollout ID")
    attempt = body.get("_ng_attempt_index", 0)
    if not is_index(attempt):
        raise GymError("invalid_request", "_ng_attempt_index must be a non-negative integer")
    task_fields = {k: v for k, v in body.items() if not k.startswith("_ng_")}
    return EpisodeId(rollout_id, attempt), task_digest(task_fields)


def is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def task_digest(task: Any) -> str:
    """NeMo Gym's task digest: SHA-256 of the task as canonical JSON (sorted, compact)."""
    canonical = json.dumps(task, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_rollout_id(value: Any) -> str:
    """`value` as a rollout ID a capture key can name, or GymError `invalid_request`: a
    capture key must parse back, so no rollout ID ends in -a<digits>."""
    if not is_rollout_id(value) or len(value) > MAX_ROLLOUT_ID:
        raise GymError(
            "invalid_request", "a rollout_id is 1-512 of A-Z a-z 0-9 . _ - (not starting . _ -)"
        )
    if _ATTEMPT_SUFFIX.search(value):
        raise GymError("invalid_request", f"rollout_id {value!r} must not end in -a<digits>")
    return value
