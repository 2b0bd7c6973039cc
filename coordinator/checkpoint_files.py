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
- A manifest this write published but whose commit was never answered (a resume came
  first) is withdrawn (`withdraw`): the commit said it did not happen, so no checkpoint
  may stand in its name.

Restore opens regular files only (never blocking on a FIFO or a device), and verifies
schema, kind, instance, digest, record count and the type of every field of the
manifest and of every record before anything is kept. A manifest missing a field it must
have is refused naming the field: the fields every manifest has (`REQUIRED`), and, in a
manifest of gym-proxy's (one with a placed table, or a map of `session_owners`), all
three of its extras (`EXTRAS`); NeMo Gym's own manifests have none of them, or only a
list of `session_owners`. The coordinator checks every
record it parses before it installs anything, and a session record whose line has the
usual shape (`records.routing_fields`) is parsed and checked by the worker that installs
it (`read_for_restore`), whose refusal undoes the whole install.

The records' format is the contract's (`coordinator.contract.records`).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import threading
from pathlib import Path
from typing import Any

import orjson

from gym_proxy.coordinator.contract import failpoints
from gym_proxy.coordinator.contract.ids import is_checkpoint_id, is_valid_id
from gym_proxy.coordinator.contract.records import (
    EncodedRecords,
    encode,
    from_disk,
    routing_fields,
    validate_record,
)

__all__ = [
    "SCHEMA_VERSION",
    "InvalidCheckpoint",
    "WriteAborted",
    "checkpoint_path",
    "write",
    "read",
    "read_for_restore",
]

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
# What every manifest holds, NeMo Gym's and gym-proxy's alike.
REQUIRED = (
    "schema_version",
    "kind",
    "instance",
    "checkpoint_id",
    "records_file",
    "records_sha256",
    "record_count",
)
# What gym-proxy's commits add (the checkpointer writes all three, as maps); a manifest
# that has none of them, or only NeMo Gym's list of `session_owners`, is NeMo Gym's.
EXTRAS = ("session_owners", "assigned_sessions", "assigned_app_sessions")
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
    linked: threading.Event | None = None,
) -> dict[str, Any]:
    """Write the records file (`encoded` parts, as the workers encoded them, then
    `records`) then the manifest; return the manifest that is in place. `linked` is set
    once this write has published the manifest itself (not found it there).

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
            if linked is not None:
                linked.set()
        except FileExistsError:
            existing = _existing_manifest(base)
            if existing != manifest:
                raise InvalidCheckpoint(
                    f"{base / MANIFEST} already exists with other content; it is never replaced"
                ) from None
            published = True  # the same commit, written before: it stands
            return manifest
        finally:
            _unlink(temp)
        _fsync_dir(base)
        return manifest
    finally:
        if created and not published:
            _unlink(records_file)


def withdraw(base: Path, manifest: dict[str, Any]) -> None:
    """Remove the manifest a write published, and its records file (a commit that was
    never answered: see the module docstring); the directory is fsynced."""
    _unlink(base / MANIFEST)
    _unlink(base / str(manifest["records_file"]))
    _fsync_dir(base)


def _existing_manifest(base: Path) -> object:
    """The document in the manifest there (any JSON), or None if it cannot be read."""
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


def _check_id_map(manifest: dict[str, Any], key: str, keys_are: str) -> None:
    value = manifest[key]
    if not isinstance(value, dict):
        raise InvalidCheckpoint(f"manifest field {key} is not an object")
    for name, target in value.items():
        if not is_valid_id(name) or not isinstance(target, str) or not is_valid_id(target):
            raise InvalidCheckpoint(
                f"manifest field {key} must map {keys_are} IDs to owner IDs "
                f"(1-64 of A-Z a-z 0-9 _ -); found {name!r}: {target!r}"
            )


def _read_extras(manifest: dict[str, Any]) -> None:
    """Check gym-proxy's extras (`EXTRAS`: every one must be there, each a map of IDs).
    A NeMo Gym manifest (no placed tables, `session_owners` absent or a list) is given
    them as what it means: each owner it lists holds its own sessions, and no table
    placed any session."""
    owners = manifest.get("session_owners", [])
    if isinstance(owners, list) and not any(k in manifest for k in EXTRAS[1:]):
        if not all(isinstance(o, str) for o in owners):
            raise InvalidCheckpoint("manifest field session_owners lists a non-string")
        manifest["session_owners"] = {owner: owner for owner in owners}
        manifest["assigned_sessions"] = {}
        manifest["assigned_app_sessions"] = {}
    for field in EXTRAS:
        if field not in manifest:
            raise InvalidCheckpoint(f"manifest has no field {field}")
    _check_id_map(manifest, "session_owners", "owner")
    _check_id_map(manifest, "assigned_sessions", "session")
    _check_id_map(manifest, "assigned_app_sessions", "session")


def read(base: Path, *, kind: str, instance: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Load and verify a checkpoint; raise InvalidCheckpoint on any doubt."""
    manifest, lines = _verified_lines(base, kind=kind, instance=instance)
    return manifest, [_parsed(manifest, number, line) for number, line in enumerate(lines, 1)]


def read_for_restore(
    base: Path, *, kind: str, instance: str
) -> tuple[dict[str, Any], list[dict[str, Any]], list[bytes]]:
    """`read` for a restore, and each record's line as the file holds it (what the
    restore sends its workers). A session record whose line has the usual shape
    (gym-proxy's workers', NeMo Gym's resources servers') is read from the line's two ends
    (`records.routing_fields`: its episode, session ID and owner, no state): the worker
    that installs it parses it whole and checks it, so it is parsed once, not in the
    proxy and again in the worker."""
    manifest, lines = _verified_lines(base, kind=kind, instance=instance)
    records = []
    for number, line in enumerate(lines, 1):
        fields = routing_fields(line)
        records.append(fields if fields is not None else _parsed(manifest, number, line))
    return manifest, records, lines


def _parsed(manifest: dict[str, Any], number: int, line: bytes) -> dict[str, Any]:
    name = manifest["records_file"]
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise InvalidCheckpoint(f"{name} line {number} is not JSON") from exc
    if isinstance(record, dict):
        record = from_disk(record)
    problem = validate_record(record)
    if problem is not None:
        raise InvalidCheckpoint(f"{name} line {number} {problem}")
    return record  # type: ignore[no-any-return]


def _verified_lines(base: Path, *, kind: str, instance: str) -> tuple[dict[str, Any], list[bytes]]:
    """The manifest and the records file's lines, every field of the manifest, the
    digest and the count verified."""
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
    for field in REQUIRED:
        if field not in manifest:
            raise InvalidCheckpoint(f"manifest has no field {field}")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise InvalidCheckpoint(f"unsupported schema_version {manifest.get('schema_version')!r}")
    if manifest.get("kind") != kind or manifest.get("instance") != instance:
        raise InvalidCheckpoint(
            f"checkpoint belongs to {manifest.get('kind')}/{manifest.get('instance')}, "
            f"not {kind}/{instance}"
        )
    checkpoint_id = manifest.get("checkpoint_id")
    if not isinstance(checkpoint_id, str) or not is_checkpoint_id(checkpoint_id):
        raise InvalidCheckpoint("manifest has no valid checkpoint_id")
    name = manifest.get("records_file")
    match = _RECORDS_NAME.match(name) if isinstance(name, str) else None
    digest = manifest.get("records_sha256")
    if not isinstance(name, str) or match is None or match.group(1) != digest:
        raise InvalidCheckpoint("records_file does not name records-<records_sha256>.jsonl")
    count = manifest.get("record_count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise InvalidCheckpoint("manifest record_count is not a non-negative integer")
    _read_extras(manifest)
    data = _read_regular(base / name)
    if hashlib.sha256(data).hexdigest() != digest:
        raise InvalidCheckpoint(f"{name} does not match records_sha256")
    lines = data.splitlines()
    if len(lines) != count:
        raise InvalidCheckpoint(f"{name} holds {len(lines)} records, manifest says {count}")
    return manifest, lines
