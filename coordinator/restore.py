"""A restore: a checkpoint read, its sessions assigned and installed on every live worker
(all or none), its episodes held until their replacement claims them (`Restore.claim`);
and, after an adoption, those claims read again from the checkpoint the dead instance
restored.

The checkpointer runs a restore as one of its calls (under its lock, cancelled by a
resume of the same checkpoint) and keeps its phase: `Restore` drives the steps and
rolls back on any failure (every worker uninstalls and reopens, the phase goes back to
idle), so a restore leaves the participant as it found it or restored.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gym_proxy.coordinator import checkpoint_files as files
from gym_proxy.coordinator import claims_recovery
from gym_proxy.coordinator.assignment import assign
from gym_proxy.coordinator.broadcast import broadcast
from gym_proxy.coordinator.commit_write import records_size
from gym_proxy.coordinator.contract import telemetry
from gym_proxy.coordinator.contract.answers import RestoreAnswer
from gym_proxy.coordinator.contract.collector import collector_paused
from gym_proxy.coordinator.contract.episodes import EpisodeId, episode_key
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.marks import RestoredClaims, RetireMarks
from gym_proxy.coordinator.contract.messages import (
    Claim,
    ClaimReply,
    Close,
    Install,
    Reopen,
    TablesUpdate,
    Uninstall,
)
from gym_proxy.coordinator.contract.records import identity, record_key
from gym_proxy.coordinator.contract.telemetry import ATTRIBUTE

if TYPE_CHECKING:
    from gym_proxy.coordinator.checkpointer import Checkpointer, LiveWorker

__all__ = ["Restore", "Selection", "select", "REOPEN_WAIT"]

log = logging.getLogger("gym_proxy.coordinator")

# A rollback does not wait longer than this for a worker's acknowledgement: a worker
# that does not answer gets the message when it wakes, or is restarted open.
REOPEN_WAIT = 2.0


@dataclass
class Selection:
    """What a restore continues: each session record as the assignment and its worker need it
    (`owner`, `session_id`, its `line` as the records file holds it, the line's `number`
    and the `identity` the worker checks it against), the episode records in scope, and
    the capture keys the bound sessions continue as."""

    sessions: list[dict[str, Any]]
    episodes: list[dict[str, Any]]
    continued: set[str]


def select(records: list[dict[str, Any]], lines: list[bytes], scope: set[str]) -> Selection:
    """Records a restore continues: sessions bound to no episode, and what `scope` lists;
    bound sessions continue as the next attempt (the worker moves them, `continuing`;
    episodes move when claimed)."""
    selection = Selection([], [], set())
    for number, (record, line) in enumerate(zip(records, lines, strict=True), 1):
        if "session_id" not in record:  # an episode at its boundary
            if record_key(record) in scope:
                selection.episodes.append(record)
            continue
        bound = record["episode_id"]
        if bound is not None:
            if episode_key(bound["rollout_id"], bound["attempt"]) not in scope:
                continue
            selection.continued.add(episode_key(bound["rollout_id"], bound["attempt"] + 1))
        selection.sessions.append(
            {
                "owner": record["owner"],
                "session_id": record["session_id"],
                "line": line,
                "number": number,
                "identity": identity(record),
            }
        )
    return selection


def _install(sessions: list[dict[str, Any]], source: str) -> Install:
    """The Install of a worker's assigned sessions: their lines, joined, and what the worker
    checks each against."""
    return Install(
        b"\n".join([*(s["line"] for s in sessions), b""]),  # one copy, each line ended
        [s["identity"] for s in sessions],
        [s["number"] for s in sessions],
        source,
    )


async def roll_back(live: list[LiveWorker], marks: RetireMarks) -> None:
    """Undo an install on every worker and reopen it (each worker handles the three
    messages in order; a silent worker costs REOPEN_WAIT once, not per message)."""
    undo = (Uninstall(), TablesUpdate({}, marks.as_dict()), Reopen())
    answers = await asyncio.gather(*(broadcast(live, m, REOPEN_WAIT) for m in undo))
    for message, answered in zip(undo, answers, strict=True):
        for worker, result in answered:
            if isinstance(result, BaseException):
                log.warning(
                    "rollback %s on worker %d failed: %s", message.TYPE, worker.slot, result
                )


@dataclass(eq=False)
class Restore:
    """The restores of one checkpointer (`cp`): its phase, tables and claims change only
    through a restore that succeeded."""

    cp: Checkpointer

    async def run(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId],
    ) -> RestoreAnswer:
        """Restore `checkpoint_dir` onto the live workers, `episode_ids` continued."""
        # The parsed records are freed by reference counting or kept as claims: a
        # collector pass over them would only stall the phase (collector.py).
        with collector_paused():
            return await self._run(checkpoint_id, deadline_ts, checkpoint_dir, episode_ids)

    async def _run(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId],
    ) -> RestoreAnswer:
        cp = self.cp
        scope = {e.key for e in episode_ids}
        arguments = (checkpoint_dir, tuple(sorted(scope)))
        cached = cp.machine.check("restore", checkpoint_id, deadline_ts, cp.clock(), arguments)
        if cached is not None:
            if not isinstance(cached, RestoreAnswer):
                raise TypeError(f"a cached {type(cached).__name__} for a restore")
            return cached
        if cp.restored_once:
            raise GymError("invalid_phase", "restore needs freshly started workers")
        await cp.exclusion.admit_checkpoint()
        live = cp.workers.live()
        if len(live) < cp.workers.expected:
            missing = cp.workers.expected - len(live)
            raise GymError("invalid_phase", f"{cp.kind_named()}-workers-unreported:{missing}")
        base = files.checkpoint_path(checkpoint_dir, cp.kind_named(), cp.instance)
        manifest, selection = await self._read(base, scope, deadline_ts)
        assignment = assign(
            selection.sessions,
            manifest["session_owners"],
            manifest["assigned_sessions"],
            [w.owner for w in live],
            manifest["assigned_app_sessions"],
            cp.tables.keeps_app_sessions,
        )
        claims = RestoredClaims(
            {
                r["episode_id"]["rollout_id"]: (r["episode_id"]["attempt"] + 1, r)
                for r in selection.episodes
            }
        )
        cp.machine.open(checkpoint_id, "restored", deadline_ts)
        cp.readiness.reset()
        try:
            closed = await cp.gather(live, Close(checkpoint_id), deadline_ts)
            for worker, reply in zip(live, closed, strict=True):
                cp.readiness.update(worker.owner, reply.report)  # status tells the truth
            source = manifest["records_file"]
            await cp.gather(
                live, lambda w: _install(assignment.records[w.owner], source), deadline_ts
            )
            tables = TablesUpdate(claims.attempts(), cp.marks.as_dict())
            await cp.gather(live, tables, deadline_ts)
        except GymError as exc:
            await self._roll_back(live)
            raise GymError(exc.code, f"{exc.detail}; nothing was installed") from exc
        except BaseException:
            await self._roll_back(live)  # cancelled by a resume: undo, then let it go on
            raise
        cp.tables.set_tables(assignment.aliases, assignment.sessions, assignment.app_sessions)
        cp.claims = claims
        cp.restored_once = True
        self._note(checkpoint_dir, scope)
        continued = set(claims.keys()) | selection.continued
        answer = RestoreAnswer("restored", manifest["checkpoint_id"], sorted(continued))
        cp.io.done("restore", manifest["checkpoint_id"], manifest["record_count"])
        return cp.machine.succeed("restore", "restored", answer, arguments)

    async def _read(
        self, base: Path, scope: set[str], deadline_ts: float
    ) -> tuple[dict[str, Any], Selection]:
        """The manifest and what the restore continues of the checkpoint at `base`."""
        cp = self.cp
        kind = cp.kind_named()
        try:
            with telemetry.span("gym.checkpoint.read") as traced:
                manifest, records, lines = await asyncio.wait_for(
                    asyncio.to_thread(
                        files.read_for_restore, base, kind=kind, instance=cp.instance
                    ),
                    cp.remaining(deadline_ts, "reading the checkpoint"),
                )
                if traced is not None:
                    size = records_size(base, manifest)
                    traced.set_attributes(
                        {ATTRIBUTE + "records": len(records), ATTRIBUTE + "bytes": size}
                    )
        except TimeoutError:
            raise GymError(
                "deadline_exceeded", "reading the checkpoint did not finish by deadline_ts"
            ) from None
        except files.InvalidCheckpoint as exc:
            raise GymError("invalid_checkpoint_state", str(exc)) from exc
        cp.io.records_read += len(records)
        cp.io.bytes_read += records_size(base, manifest)
        return manifest, select(records, lines, scope)  # the rest is freed on return

    async def _roll_back(self, live: list[LiveWorker]) -> None:
        await roll_back(live, self.cp.marks)
        self.cp.machine.abandon()

    def _note(self, checkpoint_dir: str, scope: set[str]) -> None:
        """Where this restore came from, for a gym-proxy that adopts the workers."""
        note = self.cp.restored_note
        if note is None:
            return
        try:
            claims_recovery.remember(note, checkpoint_dir, scope)
        except OSError as exc:
            log.warning("could not note the restore in %s: %s", note, exc)

    def claim(self, claim: Claim) -> ClaimReply:
        """A replacement's claim of a restored episode: its record, taken (once)."""
        # Synchronous on purpose: the record is taken and the reply written in one step.
        cp = self.cp
        if cp.machine.is_open:
            raise GymError("checkpoint_parked", "claims wait until the checkpoint resumes")
        record = cp.claims.check(EpisodeId(claim.rollout_id, claim.attempt))
        recorded, offered = record.get("task_digest"), claim.task_digest
        if recorded and offered and recorded != offered:
            # The record stays: the right replacement may still come.
            raise GymError(
                "invalid_request", f"{claim.rollout_id} continues a checkpoint of a different task"
            )
        cp.claims.take(claim.rollout_id)
        return ClaimReply(record.get("boundary"))

    async def recover_claims(self, expected_by_adopted: list[dict[str, int]]) -> None:
        """After an adoption: hold again the records of the restored episodes the adopted
        workers still expect, read from the checkpoint the dead instance restored."""
        cp = self.cp
        expected = claims_recovery.still_expected(expected_by_adopted)
        if not expected or cp.restored_note is None:
            return  # a fresh start, or adopted workers that expect no restored episode
        note = claims_recovery.recall(cp.restored_note)
        if note is None:
            return
        checkpoint_dir, scope = note
        kind = cp.kind_named()
        base = files.checkpoint_path(checkpoint_dir, kind, cp.instance)
        try:
            with collector_paused():
                _, records, lines = await asyncio.to_thread(
                    files.read_for_restore, base, kind=kind, instance=cp.instance
                )
                cp.claims = claims_recovery.claims_from(
                    select(records, lines, scope).episodes, expected, cp.marks
                )
        except (OSError, files.InvalidCheckpoint) as exc:
            log.warning(
                "the %d restored episodes awaiting their replacement cannot be continued "
                "(their replacements are refused 409 stale_attempt): %s",
                len(expected),
                exc,
            )
            return
        log.info(
            "%d restored episodes awaiting their replacement, read again from %s",
            len(cp.claims),
            checkpoint_dir,
        )
