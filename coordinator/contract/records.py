"""The checkpoint record format, as NeMo Gym's participants write it (`nemo_gym/_checkpoint/`).

Workers encode their own records with it and the coordinator validates what it reads
back, so a directory written by a NeMo Gym server restores onto gym-proxy workers and back:

- a session: `{episode_id, session_id, state, owner}` (an agent's:
  `{episode_id, session_key, session, owner}`); `owner` null for a session of a
  single-process server; `episode_id` null for a session bound to no episode, which
  NeMo Gym does not have (a gym-proxy extension: such sessions are always exported);
- an episode at its boundary: `{episode_id, task_digest, boundary}`.

`episode_id` is `{rollout_id, attempt}`. In memory every session record has the
resources field names whatever the kind; `to_disk` and `from_disk` convert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from gym_proxy.coordinator.contract.episodes import episode_key
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.ids import is_valid_id

__all__ = [
    "EncodedRecords",
    "encode",
    "validate_record",
    "is_session",
    "record_key",
    "to_disk",
    "from_disk",
    "continuing",
    "routing_fields",
    "identity",
    "restored_sessions",
]

# The two ends of a session record's line as gym-proxy's workers (both kinds) and NeMo
# Gym's resources servers write it (`json.dumps` of `ResourcesSessionRecord`, spaced): the
# episode and the session ID first, the owner last, the state between. NeMo Gym's own
# agent records carry a boundary after the session and no owner last: parsed whole. With
# IDs of their patterns (no quote, no backslash), a match at both ends of a line that
# ends its object there can only be the top-level keys; the state is not read.
_LINE_HEAD = re.compile(
    rb'\{"episode_id": ?(?:null|\{"rollout_id": ?"([A-Za-z0-9][A-Za-z0-9._-]{0,511})", ?'
    rb'"attempt": ?(0|[1-9][0-9]{0,17})\}), ?'
    rb'"(?:session_id|session_key)": ?"([A-Za-z0-9_-]{1,64})", ?"(?:state|session)": ?'
)
_LINE_TAIL = re.compile(rb', ?"owner": ?(?:null|"([A-Za-z0-9_-]{1,64})")\}\Z')
_TAIL_REACH = 80  # bytes from a line's end where its owner must begin


def is_session(record: dict[str, Any]) -> bool:
    """A session record (else an episode record)."""
    return "session_id" in record


def record_key(record: dict[str, Any]) -> str | None:
    """The capture key of the episode a record belongs to (None: bound to none)."""
    episode = record.get("episode_id")
    if episode is None:
        return None
    return episode_key(episode["rollout_id"], episode["attempt"])


@dataclass(frozen=True)
class EncodedRecords:
    """Records encoded as the records file holds them (one JSON line each), with how
    many there are and the capture keys of the episodes they belong to."""

    data: bytes
    count: int
    keys: frozenset[str]


def encode(records: list[dict[str, Any]], kind: str) -> EncodedRecords:
    """Encode records of a participant of `kind` for the records file (workers do this
    for their own records, so the coordinator only joins bytes). A state that is not JSON
    is `unexportable_state`, naming the session (or episode) and the type: the commit
    fails before anything is written."""
    dumps, newline = orjson.dumps, orjson.OPT_APPEND_NEWLINE
    lines = []
    for record in records:
        try:
            lines.append(dumps(to_disk(record, kind), option=newline))
        except TypeError as exc:  # orjson.JSONEncodeError
            raise _unexportable(record, exc) from exc
    return EncodedRecords(
        b"".join(lines),
        len(records),
        frozenset(key for r in records if (key := record_key(r))),
    )


def _unexportable(record: dict[str, Any], exc: Exception) -> GymError:
    if is_session(record):
        what = f"session {record['session_id']}"
        state = record.get("state")
    else:
        what = f"episode {record_key(record)}"
        state = record.get("boundary")
    return GymError(
        "unexportable_state",
        f"the state of {what} (a {type(state).__name__}) cannot be written as JSON: {exc}; "
        "nothing was written",
    )


def to_disk(record: dict[str, Any], kind: str) -> dict[str, Any]:
    """A record as NeMo Gym's participant of `kind` writes it."""
    if kind == "agent" and is_session(record):
        return {
            "episode_id": record["episode_id"],
            "session_key": record["session_id"],
            "session": record["state"],
            "owner": record["owner"],
        }
    return record


def from_disk(record: dict[str, Any]) -> dict[str, Any]:
    """The in-memory shape of a record read back (an agent's converted); validate it
    afterwards."""
    if "session_key" in record and "session_id" not in record:
        converted = {k: v for k, v in record.items() if k not in ("session_key", "session")}
        converted["session_id"] = record["session_key"]
        if "session" in record:
            converted["state"] = record["session"]
        converted.setdefault("owner", None)
        return converted
    if "session_id" in record:
        record.setdefault("owner", None)
    return record


def _episode_problem(value: Any) -> str | None:
    if not isinstance(value, dict) or set(value) != {"rollout_id", "attempt"}:
        return "has no episode_id {rollout_id, attempt}"
    rollout_id, attempt = value["rollout_id"], value["attempt"]
    if not isinstance(rollout_id, str) or not rollout_id:
        return "has an episode_id whose rollout_id is not a non-empty string"
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        return "has an episode_id whose attempt is not a non-negative integer"
    return None


def validate_record(record: Any) -> str | None:
    """What is wrong with one (in-memory) record, or None when it can be installed."""
    if not isinstance(record, dict):
        return "is not a JSON object"
    if is_session(record):
        if record.get("episode_id") is not None:
            problem = _episode_problem(record["episode_id"])
            if problem is not None:
                return problem
        session_id = record["session_id"]
        if not isinstance(session_id, str) or not is_valid_id(session_id):
            return "has no valid session_id (1-64 of A-Z a-z 0-9 _ -)"
        if "state" not in record:
            return "has no state"
        owner = record.get("owner")
        if owner is not None and (not isinstance(owner, str) or not is_valid_id(owner)):
            return "has an owner that is neither null nor an owner ID"
        return None
    if "task_digest" in record or "boundary" in record:
        problem = _episode_problem(record.get("episode_id"))
        if problem is not None:
            return problem
        if not isinstance(record.get("task_digest"), str):
            return "has no task_digest (a string)"
        return None
    return "is neither a session nor an episode record"


def continuing(record: dict[str, Any]) -> dict[str, Any]:
    """A restored session record as it continues: bound to its episode's next attempt
    (the attempt a replacement runs), or unchanged when bound to none."""
    episode = record.get("episode_id")
    if episode is None:
        return record
    return {**record, "episode_id": {**episode, "attempt": episode["attempt"] + 1}}


def routing_fields(line: bytes) -> dict[str, Any] | None:
    """A session record's episode, session ID and owner read from the two ends of its line
    (`{episode_id, session_id, owner}`, no state), when the line has that shape (see
    `_LINE_HEAD`); None otherwise (parse the line). What is between is not checked
    here: the worker that installs the record parses it whole and checks that it holds
    what its ends said (`restored_sessions`)."""
    head = _LINE_HEAD.match(line)
    if head is None:
        return None
    tail = _LINE_TAIL.search(line, max(head.end(), len(line) - _TAIL_REACH))
    if tail is None:
        return None
    rollout_id, attempt, session_id = head.groups()
    owner = tail.group(1)
    return {
        "episode_id": None
        if rollout_id is None
        else {"rollout_id": rollout_id.decode(), "attempt": int(attempt)},
        "session_id": session_id.decode(),
        "owner": None if owner is None else owner.decode(),
    }


def identity(record: dict[str, Any]) -> str:
    """What a session record must hold to be installed where it was placed: its session
    ID, owner and episode key, one string (IDs hold no space)."""
    return f"{record['session_id']} {record['owner'] or '-'} {record_key(record) or '-'}"


def restored_sessions(
    lines: bytes, identities: list[str], numbers: list[int], source: str
) -> list[dict[str, Any]]:
    """The session records a restore installs, from their lines as the records file
    holds them (the coordinator sends them on untouched rather than parsing them and
    encoding them again): each parsed, converted as read back, checked (`validate_record`,
    and that it holds the `identities` the coordinator placed it by), and continuing
    (`continuing`). A line that fails is `invalid_checkpoint_state` naming its line in
    `source` (`numbers`: the lines' numbers there)."""
    loads = orjson.loads
    raw = lines.splitlines()
    if len(raw) != len(identities) or len(raw) != len(numbers):
        raise GymError(
            "invalid_checkpoint_state",
            f"install of {len(raw)} lines names {len(identities)} records",
        )
    records = []
    for line, expected, number in zip(raw, identities, numbers, strict=True):
        try:
            record = loads(line)
        except orjson.JSONDecodeError:
            problem: str | None = "is not JSON"
        else:
            if isinstance(record, dict):
                record = from_disk(record)
            problem = validate_record(record)
            if problem is None and not is_session(record):
                problem = "is not a session record"
            if problem is None and identity(record) != expected:
                problem = "holds other IDs than its first and last fields"
        if problem is not None:
            raise GymError("invalid_checkpoint_state", f"{source} line {number} {problem}")
        records.append(continuing(record))
    return records
