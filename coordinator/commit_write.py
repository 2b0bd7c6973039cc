"""The file write of one commit, in a thread beside the event loop.

A commit's records (what each worker exported, encoded as it sent them, and the
restored episodes not claimed yet) and its manifest are written by
`checkpoint_files.write` in a thread: a write of megabytes must not stop the proxy's
data path. The write outlives a commit that timed out (a retry of the same commit awaits
it), and a resume stops it (`CommitWrite.stop`): before its manifest is published, or,
when it was published but no commit was answered with it, by withdrawing it, so that a
commit is answered 200 exactly when its manifest stands (`coordinator.checkpointer`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gym_proxy.coordinator import checkpoint_files as files
from gym_proxy.coordinator.contract import telemetry
from gym_proxy.coordinator.contract.answers import CheckpointDone
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.marks import RestoredClaims
from gym_proxy.coordinator.contract.messages import ExportReply
from gym_proxy.coordinator.contract.records import EncodedRecords, record_key
from gym_proxy.coordinator.contract.telemetry import ATTRIBUTE

if TYPE_CHECKING:
    from gym_proxy.coordinator.checkpointer import LiveWorker, SessionTables

__all__ = ["CheckpointIO", "CommitWrite", "Exported", "exported", "extras", "records_size"]

log = logging.getLogger("gym_proxy.coordinator")


@dataclass
class CheckpointIO:
    """Records and bytes this process wrote (commits) and read (restores), for /metrics
    and the checkpoint spans."""

    records_written: int = 0
    bytes_written: int = 0
    records_read: int = 0
    bytes_read: int = 0
    last_commit: CheckpointDone | None = None  # for `status` and its page
    last_restore: CheckpointDone | None = None

    def done(self, kind: str, checkpoint_id: str, records: int) -> None:
        """A commit or a restore (`kind`) of `checkpoint_id` finished now."""
        said = CheckpointDone(checkpoint_id, time.time(), records)
        if kind == "commit":
            self.last_commit = said
        else:
            self.last_restore = said


@dataclass(eq=False)
class CommitWrite:
    """The file write of one commit (see the module docstring)."""

    checkpoint_id: str
    target: tuple[str, tuple[str, ...] | None]  # (checkpoint_dir, scope) it was asked for
    task: asyncio.Future[dict[str, Any]]
    abort: threading.Event
    linked: threading.Event  # set once the write published its manifest
    base: Path  # the directory it writes in
    keys: frozenset[str]  # capture keys of the episodes the records belong to
    counted: bool = False  # its records and bytes are in CheckpointIO (once, retries too)
    answered: bool = False  # a commit answered 200 with its manifest

    @classmethod
    def start(
        cls,
        checkpoint_id: str,
        target: tuple[str, tuple[str, ...] | None],
        base: Path,
        kind: str,
        instance: str,
        records: Exported,
        extras: dict[str, Any],
    ) -> CommitWrite:
        """Begin writing `records` (the workers' as they encoded them, then the restored
        episodes') and then the manifest with `extras`, into `base`."""
        encoded, claimed = records.encoded, records.unclaimed
        abort, linked = threading.Event(), threading.Event()
        task = asyncio.ensure_future(
            asyncio.to_thread(
                files.write,
                base,
                kind=kind,
                instance=instance,
                checkpoint_id=checkpoint_id,
                records=claimed,
                extras=extras,
                abort=abort,
                encoded=encoded,
                linked=linked,
            )
        )
        task.add_done_callback(_retrieve)
        keys = frozenset().union(*(part.keys for part in encoded))
        keys |= {key for r in claimed if (key := record_key(r))}
        return cls(checkpoint_id, target, task, abort, linked, base, keys)

    async def manifest(self, within: float) -> dict[str, Any]:
        """The manifest once the write published it (a span with its size when traced);
        GymError when it fails, or after `within` seconds (the write goes on: a retry of
        the commit awaits it)."""
        try:
            with telemetry.span("gym.checkpoint.write") as traced:
                manifest = await asyncio.wait_for(asyncio.shield(self.task), within)
                if traced is not None:
                    size = records_size(self.base, manifest)
                    traced.set_attributes(
                        {ATTRIBUTE + "records": manifest["record_count"], ATTRIBUTE + "bytes": size}
                    )
        except TimeoutError:
            raise GymError(
                "deadline_exceeded",
                "the checkpoint write did not finish by deadline_ts; a retry waits for it",
            ) from None
        except files.InvalidCheckpoint as exc:
            raise GymError("invalid_checkpoint_state", str(exc)) from exc
        except OSError as exc:
            raise GymError(
                "checkpoint_write_failed", f"cannot write the checkpoint: {exc}"
            ) from exc
        return manifest

    @property
    def failed(self) -> bool:
        """It ended without a manifest (a retry of its commit exports again)."""
        return self.task.done() and not succeeded(self.task)

    def count(self, io: CheckpointIO, manifest: dict[str, Any]) -> None:
        """Add what it wrote to `io`, once however many commits await it."""
        if not self.counted:
            self.counted = True
            io.records_written += manifest["record_count"]
            io.bytes_written += records_size(self.base, manifest)

    async def stop(self) -> None:
        """Stop the write before it publishes; a manifest it published that no commit
        answered with (the commit was cancelled or timed out first) is withdrawn. After
        this, no manifest of it is there or can appear."""
        self.abort.set()
        await asyncio.wait({self.task})
        if not (self.linked.is_set() and not self.answered and succeeded(self.task)):
            return
        try:
            await asyncio.to_thread(files.withdraw, self.base, self.task.result())
        except OSError as exc:
            log.error(
                "checkpoint %s: could not withdraw the manifest of a commit answered with an "
                "error: %s",
                self.checkpoint_id,
                exc,
            )
        else:
            log.warning(
                "checkpoint %s: withdrew the manifest its commit published as it was resumed "
                "(the commit was not answered with it)",
                self.checkpoint_id,
            )


@dataclass(frozen=True)
class Exported:
    """What a commit writes: each worker's records as it encoded them, and the restored
    episodes not claimed yet (the coordinator holds those)."""

    encoded: list[EncodedRecords]
    unclaimed: list[dict[str, Any]]


def exported(
    replies: list[ExportReply],
    claims: RestoredClaims[dict[str, Any]],
    scope: tuple[str, ...] | None,
) -> Exported:
    """The records of a commit of `scope` (None: everything): the workers' `replies` to
    its export, and the restored episodes of `claims` in scope, each named by the
    attempt that continues it."""
    keep = None if scope is None else set(scope)
    return Exported(
        [EncodedRecords(bytes(r.blob), r.count, frozenset(r.keys)) for r in replies],
        [
            {**record, "episode_id": continuing.as_json()}
            for continuing, record in claims
            if keep is None or continuing.key in keep
        ],
    )


def extras(tables: SessionTables, live: list[LiveWorker]) -> dict[str, Any]:
    """gym-proxy's manifest fields: every owner a live token may name (an alias to the
    worker that holds its sessions now), and the sessions the tables place."""
    owners = {w.owner for w in live}
    session_owners = {o: o for o in owners}
    session_owners.update({old: new for old, new in tables.aliases.items() if new in owners})
    return {
        "session_owners": session_owners,
        "assigned_sessions": {s: o for s, o in tables.sessions.items() if o in owners},
        "assigned_app_sessions": {s: o for s, o in tables.app_sessions.items() if o in owners},
    }


def records_size(base: Path, manifest: dict[str, Any]) -> int:
    """The size of a checkpoint's records file (0 if it cannot be read now)."""
    try:
        return (base / str(manifest["records_file"])).stat().st_size
    except OSError:
        return 0


def succeeded(task: asyncio.Future[Any]) -> bool:
    return not task.cancelled() and task.exception() is None


def _retrieve(task: asyncio.Future[Any]) -> None:
    """A write nobody awaits any more (its commit timed out) must not log 'never retrieved'."""
    if not task.cancelled():
        task.exception()
