"""The files of one committed checkpoint, under `<checkpoint_dir>/gym/<kind>/<instance>/`.

- `records-<sha256>.jsonl`: one orjson line per record, written to a temp file, fsynced,
  then renamed into place;
- `manifest.json`: written to a temp file, fsynced, then hard-linked into place, which
  fails if a manifest exists, so a manifest is never replaced; then the directory is
  fsynced. The manifest appearing is the commit point: a crash before it leaves at most
  an orphan records file, and the previous checkpoint is untouched.

Restore reads the manifest and the whole records file and verifies schema, kind,
instance, digest and record count before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path
from typing import Any

import orjson

from coordinator import failpoints

__all__ = ["SCHEMA_VERSION", "InvalidCheckpoint", "checkpoint_path", "write", "read"]

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
_RECORDS_NAME = re.compile(r"records-([0-9a-f]{64})\.jsonl\Z")
_RECORD_TYPES = frozenset({"session", "episode"})


class InvalidCheckpoint(Exception):
    """The checkpoint is missing, corrupt or belongs to another server."""


def checkpoint_path(checkpoint_dir: str, kind: str, instance: str) -> Path:
    """Where this participant's files live inside a controller's checkpoint directory."""
    return Path(checkpoint_dir) / "gym" / kind / instance


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(
    base: Path,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: list[dict[str, Any]],
    session_owners: dict[str, str],
    placed_sessions: dict[str, str],
) -> dict[str, Any]:
    """Write the records file then the manifest; return the manifest."""
    base.mkdir(parents=True, exist_ok=True)
    data = b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in records)
    digest = hashlib.sha256(data).hexdigest()
    records_file = f"records-{digest}.jsonl"
    temp = base / f".{records_file}.{secrets.token_hex(4)}.tmp"
    _write_durably(temp, data)
    os.replace(temp, base / records_file)
    failpoints.hit("after-records")
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "instance": instance,
        "checkpoint_id": checkpoint_id,
        "records_file": records_file,
        "records_sha256": digest,
        "record_count": len(records),
        "session_owners": session_owners,
        "placed_sessions": placed_sessions,
    }
    temp = base / f".{MANIFEST}.{secrets.token_hex(4)}.tmp"
    _write_durably(temp, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    try:
        os.link(temp, base / MANIFEST)
    except FileExistsError as exc:
        raise InvalidCheckpoint(f"{base / MANIFEST} already exists; it is never replaced") from exc
    finally:
        temp.unlink()
    _fsync_dir(base)
    return manifest


def read(base: Path, *, kind: str, instance: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Load and verify a checkpoint; raise InvalidCheckpoint on any doubt."""
    try:
        manifest = orjson.loads((base / MANIFEST).read_bytes())
    except FileNotFoundError as exc:
        raise InvalidCheckpoint(f"no manifest at {base / MANIFEST}") from exc
    except (OSError, orjson.JSONDecodeError) as exc:
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
    name = manifest.get("records_file")
    match = _RECORDS_NAME.match(name) if isinstance(name, str) else None
    digest = manifest.get("records_sha256")
    if match is None or match.group(1) != digest:
        raise InvalidCheckpoint("records_file does not name records-<records_sha256>.jsonl")
    for key in ("session_owners", "placed_sessions"):
        if not isinstance(manifest.get(key), dict):
            raise InvalidCheckpoint(f"manifest field {key} is not an object")
    try:
        data = (base / name).read_bytes()
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot read {name}: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != digest:
        raise InvalidCheckpoint(f"{name} does not match records_sha256")
    lines = data.splitlines()
    if len(lines) != manifest.get("record_count"):
        raise InvalidCheckpoint(
            f"{name} holds {len(lines)} records, manifest says {manifest.get('record_count')}"
        )
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise InvalidCheckpoint(f"{name} line {number} is not JSON") from exc
        if not isinstance(record, dict) or record.get("type") not in _RECORD_TYPES:
            raise InvalidCheckpoint(f"{name} line {number} is not a record")
        records.append(record)
    return manifest, records
