"""The files of one committed checkpoint, under `<checkpoint_dir>/gym/<kind>/<instance>/`.

- `records-<sha256>.jsonl`: one orjson line per record, written to a temp file, fsynced,
  then renamed into place;
- `manifest.json`: written to a temp file, fsynced, then hard-linked into place, which
  fails if a manifest exists, so a manifest is never replaced; then the directory is
  fsynced. The manifest appearing is the commit point: a crash before it leaves at most
  an orphan records file, and the previous checkpoint is untouched. A failed write
  (disk full) removes its temp files and the records file it created.
- A commit onto an existing manifest with identical content returns that manifest; with
  other content it fails (and removes the records file it wrote).

Restore opens regular files only (never blocking on a FIFO or a device), and verifies
schema, kind, instance, digest, record count and the type of every field of the
manifest and of every record before anything is installed.

Records are NeMo Gym's (`nemo_gym/_checkpoint/`), so a directory written by a NeMo Gym
server restores onto gym-proxy workers and back:

- a session: `{episode_id, session_id, state, owner}` (an agent's:
  `{episode_id, session_key, session, owner}`); `owner` null for a session of a
  single-process server; `episode_id` null for a session bound to no episode, which
  NeMo Gym does not have (a gym-proxy extension: such sessions are always exported);
- an episode at its boundary: `{episode_id, task_digest, boundary}`.

`episode_id` is `{rollout_id, attempt}`. In memory every session record has the
resources field names whatever the kind; `to_disk` and `from_disk` convert.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from coordinator import failpoints
from coordinator.episode_ids import episode_key, parse_episode_key
from coordinator.errors import GymError
from coordinator.phases import CHECKPOINT_ID
from proxy.session_tokens import is_valid_id

__all__ = [
    "SCHEMA_VERSION",
    "EncodedRecords",
    "InvalidCheckpoint",
    "WriteAborted",
    "encode",
    "checkpoint_path",
    "write",
    "read",
    "validate_record",
    "is_session",
    "record_key",
    "to_disk",
    "from_disk",
]

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
_RECORDS_NAME = re.compile(r"records-([0-9a-f]{64})\.jsonl\Z")
_MANIFEST_LIMIT = 256 * 1024 * 1024


class InvalidCheckpoint(Exception):
    """The checkpoint is missing, corrupt or belongs to another server."""


class WriteAborted(Exception):
    """A resume stopped the write before the manifest was published."""


def checkpoint_path(checkpoint_dir: str, kind: str, instance: str) -> Path:
    """Where this participant's files live inside a controller's checkpoint directory."""
    return Path(checkpoint_dir) / "gym" / kind / instance


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


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
    """The in-memory shape of a record read back (agents' and older gym-proxy records
    converted); validate it afterwards."""
    if "session_key" in record and "session_id" not in record:
        converted = {k: v for k, v in record.items() if k not in ("session_key", "session")}
        converted["session_id"] = record["session_key"]
        converted["state"] = record.get("session")
        converted.setdefault("owner", None)
        return converted
    legacy = record.get("type")
    if legacy == "session":  # gym-proxy 0.1
        episode = record.get("episode")
        identity = parse_episode_key(episode) if isinstance(episode, str) and episode else None
        return {
            "episode_id": None if identity is None else identity.as_json(),
            "session_id": record.get("session_id"),
            "state": record.get("value"),
            "owner": record.get("owner"),
        }
    if legacy == "episode":
        identity = {"rollout_id": record.get("rollout_id"), "attempt": record.get("attempt")}
        return {
            "episode_id": identity,
            "task_digest": "",
            "boundary": record.get("state"),
        }
    if "session_id" in record:
        record.setdefault("owner", None)
    return record


def write(
    base: Path,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: list[dict[str, Any]],
    extras: dict[str, Any],
    abort: threading.Event | None = None,
    encoded: list[EncodedRecords] | None = None,
) -> dict[str, Any]:
    """Write the records file (`encoded` parts, as the workers encoded them, then
    `records`) then the manifest; return the manifest that is in place.

    Raises OSError (nothing of this write is left behind), InvalidCheckpoint (another
    manifest with other content is there) or WriteAborted (`abort` was set first).
    """
    base.mkdir(parents=True, exist_ok=True)
    parts = [*(encoded or ()), encode(records, kind)]
    data = b"".join(part.data for part in parts)
    digest = hashlib.sha256(data).hexdigest()
    records_file = base / f"records-{digest}.jsonl"
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "instance": instance,
        "checkpoint_id": checkpoint_id,
        "records_file": records_file.name,
        "records_sha256": digest,
        "record_count": sum(part.count for part in parts),
        **extras,
    }
    created = not records_file.exists()
    temp = base / f".{records_file.name}.{secrets.token_hex(4)}.tmp"
    published = False
    try:
        if created:
            try:
                _write_durably(temp, data)
                os.replace(temp, records_file)
            finally:
                _unlink(temp)
        failpoints.hit("after-records")
        if abort is not None and abort.is_set():
            raise WriteAborted("resumed before the manifest was published")
        temp = base / f".{MANIFEST}.{secrets.token_hex(4)}.tmp"
        try:
            _write_durably(temp, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
            os.link(temp, base / MANIFEST)
            published = True
        except FileExistsError:
            existing = _existing_manifest(base)
            if existing != manifest:
                raise InvalidCheckpoint(
                    f"{base / MANIFEST} already exists with other content; it is never replaced"
                ) from None
            published = True  # the same commit, written before: it stands
            return existing
        finally:
            _unlink(temp)
        _fsync_dir(base)
        return manifest
    finally:
        if created and not published:
            _unlink(records_file)


def _existing_manifest(base: Path) -> dict[str, Any] | None:
    try:
        return orjson.loads(_read_regular(base / MANIFEST, _MANIFEST_LIMIT))
    except (OSError, InvalidCheckpoint, orjson.JSONDecodeError):
        return None


def _read_regular(path: Path, limit: int | None = None) -> bytes:
    """The bytes of a regular file; InvalidCheckpoint for anything else (never blocks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise InvalidCheckpoint(f"{path} does not exist") from exc
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot open {path}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidCheckpoint(f"{path} is not a regular file")
        if limit is not None and info.st_size > limit:
            raise InvalidCheckpoint(f"{path} is larger than {limit} bytes")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read()
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot read {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def _id_map(manifest: dict[str, Any], key: str, keys_are: str) -> dict[str, str]:
    value = manifest.get(key, {})
    if not isinstance(value, dict):
        raise InvalidCheckpoint(f"manifest field {key} is not an object")
    for name, target in value.items():
        if not is_valid_id(name) or not isinstance(target, str) or not is_valid_id(target):
            raise InvalidCheckpoint(
                f"manifest field {key} must map {keys_are} IDs to owner IDs "
                f"(1-64 of A-Z a-z 0-9 _ -); found {name!r}: {target!r}"
            )
    return value


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


def read(base: Path, *, kind: str, instance: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Load and verify a checkpoint; raise InvalidCheckpoint on any doubt."""
    path = base / MANIFEST
    try:
        manifest = orjson.loads(_read_regular(path, _MANIFEST_LIMIT))
    except InvalidCheckpoint as exc:
        if not path.exists():
            raise InvalidCheckpoint(f"no manifest at {path}") from exc
        raise
    except orjson.JSONDecodeError as exc:
        raise InvalidCheckpoint(f"unreadable manifest: {exc}") from exc
    if not isinstance(manifest, dict):
        raise InvalidCheckpoint("manifest is not a JSON object")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise InvalidCheckpoint(f"unsupported schema_version {manifest.get('schema_version')!r}")
    if manifest.get("kind") != kind or manifest.get("instance") != instance:
        raise InvalidCheckpoint(
            f"checkpoint belongs to {manifest.get('kind')}/{manifest.get('instance')}, "
            f"not {kind}/{instance}"
        )
    checkpoint_id = manifest.get("checkpoint_id")
    if not isinstance(checkpoint_id, str) or not CHECKPOINT_ID.match(checkpoint_id):
        raise InvalidCheckpoint("manifest has no valid checkpoint_id")
    name = manifest.get("records_file")
    match = _RECORDS_NAME.match(name) if isinstance(name, str) else None
    digest = manifest.get("records_sha256")
    if match is None or match.group(1) != digest:
        raise InvalidCheckpoint("records_file does not name records-<records_sha256>.jsonl")
    count = manifest.get("record_count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise InvalidCheckpoint("manifest record_count is not a non-negative integer")
    if isinstance(manifest.get("session_owners"), list):
        # NeMo Gym lists the owners a live cookie may name; each holds its own sessions.
        owners = manifest["session_owners"]
        if not all(isinstance(o, str) for o in owners):
            raise InvalidCheckpoint("manifest field session_owners lists a non-string")
        manifest["session_owners"] = {owner: owner for owner in owners}
    manifest["session_owners"] = _id_map(manifest, "session_owners", "owner")
    manifest["placed_sessions"] = _id_map(manifest, "placed_sessions", "session")
    data = _read_regular(base / name)
    if hashlib.sha256(data).hexdigest() != digest:
        raise InvalidCheckpoint(f"{name} does not match records_sha256")
    lines = data.splitlines()
    if len(lines) != count:
        raise InvalidCheckpoint(f"{name} holds {len(lines)} records, manifest says {count}")
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise InvalidCheckpoint(f"{name} line {number} is not JSON") from exc
        if isinstance(record, dict):
            record = from_disk(record)
        problem = validate_record(record)
        if problem is not None:
            raise InvalidCheckpoint(f"{name} line {number} {problem}")
        records.append(record)
    return manifest, records
