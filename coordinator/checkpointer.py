"""The checkpointer, the coordinator the proxy hosts: N workers as one checkpoint participant.

It drives the phase machine (`coordinator.phases`), talks to every worker over its
channel, writes and verifies checkpoint files (`coordinator.checkpoint_files`), places restored
sessions (`coordinator.placement`) and holds restored episode records until exactly one
worker claims each.

No worker can hang a control call: every request to a worker is bounded by the call's
`deadline_ts`. Prepare sends `close` without waiting for the replies (a worker that does
not answer stays a blocker) and answers `preparing` at its deadline. Commit, restore and
retire run one at a time under a lock and fail with `deadline_exceeded` when a worker
does not answer in time (a failed restore rolls back). A resume never waits behind them:
it cancels a running commit or restore of its checkpoint (the commit's file write is
stopped before its manifest is published, and a manifest published by a commit it
cancelled before its answer is withdrawn: a commit answered 409 leaves none), then
reopens every live worker at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gym_proxy.coordinator import checkpoint_files as files
from gym_proxy.coordinator import claims_recovery
from gym_proxy.coordinator.broadcast import broadcast
from gym_proxy.coordinator.contract import telemetry
from gym_proxy.coordinator.contract.channel import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    RemoteError,
)
from gym_proxy.coordinator.contract.collector import collector_paused
from gym_proxy.coordinator.contract.episodes import EpisodeId, episode_key
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.marks import RestoredClaims, RetireMarks
from gym_proxy.coordinator.contract.messages import (
    Claim,
    ClaimReply,
    Close,
    CloseReply,
    EpisodeRef,
    Export,
    Forget,
    Install,
    Message,
    Ready,
    Register,
    RegisterReply,
    Release,
    Reopen,
    Request,
    Retire,
    Stop,
    Tables,
    TablesUpdate,
    Uninstall,
)
from gym_proxy.coordinator.contract.records import EncodedRecords, identity, record_key
from gym_proxy.coordinator.contract.telemetry import ATTRIBUTE
from gym_proxy.coordinator.exclusion import Exclusion
from gym_proxy.coordinator.phases import PhaseMachine
from gym_proxy.coordinator.placement import place
from gym_proxy.coordinator.readiness import Readiness

__all__ = ["LiveWorker", "Workers", "SessionTables", "Checkpointer"]

log = logging.getLogger("gym_proxy.coordinator")
R = TypeVar("R", bound=Message)

# A resume or a rollback does not wait longer than this for a worker's acknowledgement:
# a worker that does not answer gets the message when it wakes, or is restarted open.
REOPEN_WAIT = 2.0
CLOSE_WAIT = 2.0
LEASE_CHECK = 1.0  # seconds between looks at the lease (its grace is minutes)


@dataclass(frozen=True)
class LiveWorker:
    slot: int
    owner: str
    pid: int
    channel: Channel
    in_flight: int


class Workers(Protocol):
    """The workers as the coordinator sees them (the proxy's supervisor)."""

    @property
    def expected(self) -> int: ...

    def live(self) -> list[LiveWorker]: ...


class SessionTables(Protocol):
    """The tables a checkpoint writes and a restore replaces (the proxy's router)."""

    aliases: dict[str, str]  # old owner -> the owner its sessions went to
    sessions: dict[str, str]  # gym-proxy's sessions the session table places
    app_sessions: dict[str, str]  # the app's own sessions it places

    @property
    def keeps_app_sessions(self) -> bool:
        """The workers key their sessions (and records) by the app's own session IDs."""
        ...

    def set_tables(
        self,
        aliases: dict[str, str],
        sessions: dict[str, str],
        app_sessions: dict[str, str] | None = None,
    ) -> None: ...


@dataclass(eq=False)
class _Write:
    """The file write of one commit: runs in a thread, outlives a commit that timed out
    (a retry awaits it), and is stopped before publishing when the checkpoint resumes."""

    checkpoint_id: str
    target: tuple[str, tuple[str, ...] | None]  # (checkpoint_dir, scope) it was asked for
    task: asyncio.Future[dict[str, Any]]
    abort: threading.Event
    linked: threading.Event  # set once the write published its manifest
    base: Path  # the directory it writes in
    keys: frozenset[str]  # capture keys of the episodes the records belong to
    counted: bool = False  # its records and bytes are in CheckpointIO (once, retries too)
    answered: bool = False  # a commit answered 200 with its manifest


@dataclass
class CheckpointIO:
    """Records and bytes this process wrote (commits) and read (restores), for /metrics
    and the checkpoint spans."""

    records_written: int = 0
    bytes_written: int = 0
    records_read: int = 0
    bytes_read: int = 0


@dataclass(eq=False)
class Checkpointer:
    workers: Workers
    tables: SessionTables
    instance: str
    lease_grace: float
    clock: Callable[[], float] = time.time
    kind: str | None = None
    machine: PhaseMachine = field(init=False)
    readiness: Readiness = field(default_factory=Readiness)
    claims: RestoredClaims[dict[str, Any]] = field(default_factory=RestoredClaims)
    marks: RetireMarks = field(default_factory=RetireMarks)
    restored_once: bool = False
    # Where a restore notes its checkpoint for a gym-proxy that adopts the workers
    # (claims_recovery.py; None: nowhere), and what the adopted workers still expect.
    restored_note: str | None = None
    _expected_by_adopted: list[dict[str, int]] = field(default_factory=list)
    exclusion: Exclusion = field(init=False)  # shared with the moves and live operations
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _op: tuple[str, asyncio.Task[dict[str, Any]]] | None = None
    _write: _Write | None = None
    _sends: set[asyncio.Future[CloseReply]] = field(default_factory=set)
    io: CheckpointIO = field(default_factory=CheckpointIO)
    _warned_restart_only: bool = False

    def __post_init__(self) -> None:
        self.machine = PhaseMachine(self.lease_grace)
        self.exclusion = Exclusion(lambda: self.open_checkpoint)
        self.machine.on_idle = self.exclusion.freed

    # ---- worker side ------------------------------------------------------------
    def register_reply(self, registration: Register) -> RegisterReply:
        """What a (late) joining worker needs: pending claims, marks, an open checkpoint.
        A worker a dead instance left brings the marks it enforces (marks only grow)."""
        if self.kind is None:
            self.kind = registration.kind
        if registration.restart_only and not self._warned_restart_only:
            self._warned_restart_only = True
            log.warning(
                "%s declares no session state, so it is a restart-only participant: a "
                "checkpoint exports none of its sessions and names the rollouts using them "
                "as restarts (declare a session dict, hooks or the session store to export "
                "them: docs/nemo_gym.md, 'State without code')",
                self.instance,
            )
        if registration.rejoining:
            self.marks.merge(registration.marks)
            self.restored_once = True  # its state is the dead instance's: no restore onto it
            self._expected_by_adopted.append(registration.expected)
        open_id = self.machine.checkpoint_id if self.machine.is_open else None
        return RegisterReply(self._tables(), open_id)

    def on_lost(self, owner: str) -> None:
        self.readiness.forget(owner, lost_while_open=self.machine.is_open)
        self.machine.unprepare()

    async def on_message(self, owner: str, message: Message) -> Message | None:
        """A worker's message: a report or a claim."""
        match message:
            case Ready():
                if message.checkpoint_id == self.machine.checkpoint_id:
                    self.readiness.update(owner, message)
                return None
            case Claim():
                return self._claim(message)
        raise GymError("invalid_request", f"{message.TYPE} is not a message for the coordinator")

    def _claim(self, claim: Claim) -> ClaimReply:
        # Synchronous on purpose: the record is taken and the reply written in one step.
        if self.machine.is_open:
            raise GymError("checkpoint_parked", "claims wait until the checkpoint resumes")
        record = self.claims.check(EpisodeId(claim.rollout_id, claim.attempt))
        recorded, offered = record.get("task_digest"), claim.task_digest
        if recorded and offered and recorded != offered:
            # The record stays: the right replacement may still come.
            raise GymError(
                "invalid_request", f"{claim.rollout_id} continues a checkpoint of a different task"
            )
        self.claims.take(claim.rollout_id)
        return ClaimReply(record.get("boundary"))

    # ---- control operations -------------------------------------------------------
    def status(self) -> dict[str, Any]:
        live = self.workers.live()
        return {
            "kind": self.kind,
            "instance": self.instance,
            "phase": self.machine.phase,
            "checkpoint_id": self.machine.checkpoint_id,
            "lease_expires_at": self.machine.lease_expires_at,
            "report": self._report(live),
            "workers": [
                {
                    "slot": w.slot,
                    "owner": w.owner,
                    "pid": w.pid,
                    "in_flight": w.in_flight,
                    "ready": self.readiness.worker_ready(w.owner),
                }
                for w in live
            ],
            "expected_workers": self.workers.expected,
            "session_aliases": dict(self.tables.aliases),
            "routed_sessions": len(self.tables.sessions) + len(self.tables.app_sessions),
            "restored_pending": self.claims.keys(),
            "retired_rollouts": len(self.marks),
            "operation": self.exclusion.operation,
        }

    def _report(self, live: list[LiveWorker] | None = None) -> dict[str, Any]:
        if not self.machine.is_open:
            return {
                "ready": False,
                "blockers": [],
                "blocker_count": 0,
                "counts": {},
                "restarts": [],
            }
        return self.readiness.report(
            live or self.workers.live(), self.workers.expected, self.kind or "resources"
        )

    @property
    def open_checkpoint(self) -> str | None:
        """The ID of the checkpoint that is open, if one is."""
        return self.machine.checkpoint_id if self.machine.is_open else None

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        async with self._lock:
            cached = self.machine.check("prepare", checkpoint_id, deadline_ts, self.clock())
            if cached is not None:
                return cached
            await self.exclusion.give_way()
            self.exclusion.refuse_checkpoint()
            if not self.machine.is_open:
                self.machine.open(checkpoint_id, "preparing", deadline_ts)
                self.readiness.reset()
                self._send_close(checkpoint_id, deadline_ts)
            else:
                self.machine.extend(deadline_ts)
        await self.readiness.wait_ready(
            lambda: self._report()["ready"] or self.machine.checkpoint_id != checkpoint_id,
            deadline_ts - self.clock(),
        )
        async with self._lock:
            if self.machine.checkpoint_id != checkpoint_id:
                raise GymError("stale_checkpoint", "the checkpoint was resumed")
            if "prepare" in self.machine.replies:
                return self.machine.replies["prepare"][1]
            report = self._report()
            if not report["ready"]:
                return {"phase": "preparing", "report": report}
            return self.machine.succeed(
                "prepare", "prepared", {"phase": "prepared", "report": report}
            )

    def _send_close(self, checkpoint_id: str, deadline_ts: float) -> None:
        """Close every live worker; each reply lands in readiness when it comes (a worker
        gets at least CLOSE_WAIT to answer, even for a prepare whose deadline passed)."""
        timeout = max(CLOSE_WAIT, deadline_ts - self.clock())
        for worker in self.workers.live():
            sent = asyncio.ensure_future(
                worker.channel.request(Close(checkpoint_id), within=timeout)
            )
            self._sends.add(sent)
            sent.add_done_callback(self._sends.discard)
            sent.add_done_callback(functools.partial(self._closed, worker, checkpoint_id))

    def _closed(
        self, worker: LiveWorker, checkpoint_id: str, done: asyncio.Future[CloseReply]
    ) -> None:
        if done.cancelled():
            return
        exc = done.exception()
        if exc is not None:
            log.warning("close to worker %d failed: %s", worker.slot, exc)
        elif self.machine.checkpoint_id == checkpoint_id:
            self.readiness.update(worker.owner, done.result().report)

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId] | None,
        stop: bool = False,
    ) -> dict[str, Any]:
        return await self._exclusive(
            checkpoint_id,
            lambda: self._commit(checkpoint_id, deadline_ts, checkpoint_dir, episode_ids, stop),
        )

    async def _commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId] | None,
        stop: bool,
    ) -> dict[str, Any]:
        scope = None if episode_ids is None else tuple(sorted({e.key for e in episode_ids}))
        arguments = (checkpoint_dir, scope)
        cached = self.machine.check("commit", checkpoint_id, deadline_ts, self.clock(), arguments)
        if cached is not None:
            return cached
        self.machine.extend(deadline_ts)  # the lease covers the call's own deadline
        live = self.workers.live()
        write = self._write
        if write is not None and write.task.done() and not _succeeded(write.task):
            write = self._write = None  # the write failed: this retry exports again
        if write is None:
            report = self._report(live)
            if not report["ready"]:
                blockers = ", ".join(report["blockers"][:5])
                raise GymError("invalid_phase", f"participant is no longer ready: {blockers}")
            restarted = sorted(set(report["restarts"]) & set(scope or ()))
            if restarted:
                # This participant holds none of a restart's state: continuing it would
                # resume a rollout whose other parts start over.
                raise GymError("restart_in_scope", f"the scope names restarts: {restarted}")
            write = await self._start_write(checkpoint_id, checkpoint_dir, scope, live, deadline_ts)
        elif write.target != (checkpoint_dir, scope):
            raise GymError(
                "checkpoint_conflict", "a retried commit must name the same directory and scope"
            )
        try:
            with telemetry.span("gym.checkpoint.write") as traced:
                manifest = await asyncio.wait_for(
                    asyncio.shield(write.task), self._remaining(deadline_ts, "the checkpoint write")
                )
                if traced is not None:
                    size = _size(checkpoint_dir, self._kind(), self.instance, manifest)
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
            detail = f"cannot write the checkpoint: {exc}"
            raise GymError("checkpoint_write_failed", detail) from exc
        if not write.counted:
            write.counted = True
            self.io.records_written += manifest["record_count"]
            self.io.bytes_written += _size(checkpoint_dir, self._kind(), self.instance, manifest)
        if scope is not None:
            keep = set(scope)
            await self._gather(live, Release(sorted(keep)), deadline_ts)
            self.claims.keep_only(keep)
        if stop:
            await self._stop_workers(live, deadline_ts)
        exported = sorted(write.keys)
        write.answered = True
        return self.machine.succeed(
            "commit",
            "committed",
            {"phase": "committed", "manifest": manifest, "episode_ids": exported},
            arguments,
        )

    async def _stop_workers(self, live: list[LiveWorker], deadline_ts: float) -> None:
        """After a commit with `stop: true`: each app frees what it can, best effort."""
        within = max(0.0, deadline_ts - self.clock())
        for worker, result in await broadcast(live, Stop(), within):
            if isinstance(result, BaseException):
                log.warning("stop on worker %d failed: %s", worker.slot, result)

    async def _start_write(
        self,
        checkpoint_id: str,
        checkpoint_dir: str,
        scope: tuple[str, ...] | None,
        live: list[LiveWorker],
        deadline_ts: float,
    ) -> _Write:
        export = Export(checkpoint_id, None if scope is None else list(scope), self._kind())
        replies = await self._gather(live, export, deadline_ts)
        encoded = [
            EncodedRecords(bytes(reply.blob), reply.count, frozenset(reply.keys))
            for reply in replies
        ]
        records = []
        keep = None if scope is None else set(scope)
        for continuing, record in self.claims:
            if keep is None or continuing.key in keep:
                # Not claimed yet: exported again, named by the attempt that continues it.
                records.append({**record, "episode_id": continuing.as_json()})
        owners = {w.owner for w in live}
        session_owners = {o: o for o in owners}
        session_owners.update(
            {old: new for old, new in self.tables.aliases.items() if new in owners}
        )
        placed = {s: o for s, o in self.tables.sessions.items() if o in owners}
        placed_app = {s: o for s, o in self.tables.app_sessions.items() if o in owners}
        abort, linked = threading.Event(), threading.Event()
        base = files.checkpoint_path(checkpoint_dir, self._kind(), self.instance)
        task = asyncio.ensure_future(
            asyncio.to_thread(
                files.write,
                base,
                kind=self._kind(),
                instance=self.instance,
                checkpoint_id=checkpoint_id,
                records=records,
                extras={
                    "session_owners": session_owners,
                    "placed_sessions": placed,
                    "placed_app_sessions": placed_app,
                },
                abort=abort,
                encoded=encoded,
                linked=linked,
            )
        )
        task.add_done_callback(_retrieve)
        keys = frozenset().union(*(part.keys for part in encoded))
        keys |= {key for r in records if (key := record_key(r))}
        self._write = _Write(
            checkpoint_id, (checkpoint_dir, scope), task, abort, linked, base, keys
        )
        return self._write

    async def restore(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId],
    ) -> dict[str, Any]:

        async def restore() -> dict[str, Any]:
            # The parsed records are freed by reference counting or kept as claims: a
            # collector pass over them would only stall the phase (collector.py).
            with collector_paused():
                return await self._restore(checkpoint_id, deadline_ts, checkpoint_dir, episode_ids)

        return await self._exclusive(checkpoint_id, restore)

    async def _restore(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId],
    ) -> dict[str, Any]:
        scope = {e.key for e in episode_ids}
        arguments = (checkpoint_dir, tuple(sorted(scope)))
        cached = self.machine.check("restore", checkpoint_id, deadline_ts, self.clock(), arguments)
        if cached is not None:
            return cached
        if self.restored_once:
            raise GymError("invalid_phase", "restore needs freshly started workers")
        await self.exclusion.give_way()
        self.exclusion.refuse_checkpoint()
        live = self.workers.live()
        if len(live) < self.workers.expected:
            missing = self.workers.expected - len(live)
            raise GymError("invalid_phase", f"{self._kind()}-workers-unreported:{missing}")
        base = files.checkpoint_path(checkpoint_dir, self._kind(), self.instance)
        try:
            with telemetry.span("gym.checkpoint.read") as traced:
                manifest, records, lines = await asyncio.wait_for(
                    asyncio.to_thread(
                        files.read_for_restore, base, kind=self._kind(), instance=self.instance
                    ),
                    self._remaining(deadline_ts, "reading the checkpoint"),
                )
                if traced is not None:
                    size = _size(checkpoint_dir, self._kind(), self.instance, manifest)
                    traced.set_attributes(
                        {ATTRIBUTE + "records": len(records), ATTRIBUTE + "bytes": size}
                    )
        except TimeoutError:
            raise GymError(
                "deadline_exceeded", "reading the checkpoint did not finish by deadline_ts"
            ) from None
        except files.InvalidCheckpoint as exc:
            raise GymError("invalid_checkpoint_state", str(exc)) from exc
        self.io.records_read += len(records)
        self.io.bytes_read += _size(checkpoint_dir, self._kind(), self.instance, manifest)
        selection = _select(records, lines, scope)
        del records, lines  # what is not selected is freed before the installs
        placement = place(
            selection.sessions,
            manifest["session_owners"],
            manifest["placed_sessions"],
            [w.owner for w in live],
            manifest["placed_app_sessions"],
            self.tables.keeps_app_sessions,
        )
        claims = RestoredClaims(
            {
                r["episode_id"]["rollout_id"]: (r["episode_id"]["attempt"] + 1, r)
                for r in selection.episodes
            }
        )
        self.machine.open(checkpoint_id, "restored", deadline_ts)
        self.readiness.reset()
        try:
            closed = await self._gather(live, Close(checkpoint_id), deadline_ts)
            for worker, reply in zip(live, closed, strict=True):
                self.readiness.update(worker.owner, reply.report)  # status tells the truth
            source = manifest["records_file"]
            await self._gather(
                live, lambda w: _install(placement.records[w.owner], source), deadline_ts
            )
            tables = TablesUpdate(claims.attempts(), self.marks.as_dict())
            await self._gather(live, tables, deadline_ts)
        except GymError as exc:
            await self._rollback(live)
            raise GymError(exc.code, f"{exc.detail}; nothing was installed") from exc
        except BaseException:
            await self._rollback(live)  # cancelled by a resume: undo, then let it go on
            raise
        self.tables.set_tables(placement.aliases, placement.sessions, placement.app_sessions)
        self.claims = claims
        self.restored_once = True
        if self.restored_note is not None:
            try:
                claims_recovery.remember(self.restored_note, checkpoint_dir, scope)
            except OSError as exc:
                log.warning("could not note the restore in %s: %s", self.restored_note, exc)
        continued = set(claims.keys()) | selection.continued
        restored = {
            "phase": "restored",
            "source_checkpoint_id": manifest["checkpoint_id"],
            "restored": sorted(continued),
        }
        return self.machine.succeed("restore", "restored", restored, arguments)

    async def recover_claims(self) -> None:
        """After an adoption: hold again the records of the restored episodes the adopted
        workers still expect, read from the checkpoint the dead instance restored."""
        expected = claims_recovery.still_expected(self._expected_by_adopted)
        self._expected_by_adopted = []
        if not expected or self.restored_note is None:
            return  # a fresh start, or adopted workers that expect no restored episode
        note = claims_recovery.recall(self.restored_note)
        if note is None:
            return
        checkpoint_dir, scope = note
        base = files.checkpoint_path(checkpoint_dir, self._kind(), self.instance)
        try:
            with collector_paused():
                _, records, lines = await asyncio.to_thread(
                    files.read_for_restore, base, kind=self._kind(), instance=self.instance
                )
                self.claims = claims_recovery.claims_from(
                    _select(records, lines, scope).episodes, expected, self.marks
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
            len(self.claims),
            checkpoint_dir,
        )

    async def _rollback(self, live: list[LiveWorker]) -> None:
        """Undo an install on every worker and reopen it (each worker handles the three
        messages in order; a silent worker costs REOPEN_WAIT once, not per message)."""
        undo = (Uninstall(), TablesUpdate({}, self.marks.as_dict()), Reopen())
        answers = await asyncio.gather(*(broadcast(live, m, REOPEN_WAIT) for m in undo))
        for message, answered in zip(undo, answers, strict=True):
            for worker, result in answered:
                if isinstance(result, BaseException):
                    log.warning(
                        "rollback %s on worker %d failed: %s", message.TYPE, worker.slot, result
                    )
        self.machine.abandon()

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        # Never behind the lock: only the lease moves.
        self.machine.check("renew", checkpoint_id, deadline_ts, self.clock())
        self.machine.extend(deadline_ts)
        return {"phase": self.machine.phase, "lease_expires_at": self.machine.lease_expires_at}

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        if checkpoint_id in self.machine.resumed:  # never behind another call
            return {"phase": "idle", "idempotent": True}
        stopped = False
        if self.machine.checkpoint_id == checkpoint_id:
            stopped = await self._stop_work(checkpoint_id)
        async with self._lock:
            if stopped and not self.machine.is_open:
                # It stopped a restore, whose rollback left the participant idle: this
                # resume did something, and its ID is fenced like any resumed one.
                self.machine.remember(checkpoint_id)
                return {"phase": "idle", "idempotent": False}
            cached = self.machine.check("resume", checkpoint_id, deadline_ts, self.clock())
            if cached is not None:
                return cached
            await self._reopen()
            return {"phase": "idle", "idempotent": False}

    async def _stop_work(self, checkpoint_id: str) -> bool:
        """Stop a commit or restore of `checkpoint_id` that is running (resume wins);
        True if one was running."""
        op = self._op
        stopped = op is not None and op[0] == checkpoint_id and not op[1].done()
        if op is not None and stopped:
            op[1].cancel()
            await asyncio.wait({op[1]})
        write = self._write
        if write is not None and write.checkpoint_id == checkpoint_id:
            await self._stop_write(write)
        return stopped

    async def _stop_write(self, write: _Write) -> None:
        """Stop the write before it publishes; a manifest it published that no commit
        answered with (the commit was cancelled or timed out first) is withdrawn. After
        this, no manifest of it is there or can appear."""
        write.abort.set()
        await asyncio.wait({write.task})
        if write.linked.is_set() and not write.answered and _succeeded(write.task):
            manifest = write.task.result()
            try:
                await asyncio.to_thread(files.withdraw, write.base, manifest)
            except OSError as exc:
                log.error(
                    "checkpoint %s: could not withdraw the manifest of a commit answered "
                    "with an error: %s",
                    write.checkpoint_id,
                    exc,
                )
            else:
                log.warning(
                    "checkpoint %s: withdrew the manifest its commit published as it was "
                    "resumed (the commit was not answered with it)",
                    write.checkpoint_id,
                )

    async def _reopen(self) -> None:
        write = self._write
        if write is not None:
            await self._stop_write(write)
            self._write = None
        self.machine.close()
        self.readiness.reset()
        for worker, result in await broadcast(self.workers.live(), Reopen(), REOPEN_WAIT):
            if isinstance(result, BaseException):
                log.warning("reopen of worker %d failed: %s", worker.slot, result)

    async def retire(
        self, checkpoint_id: str, deadline_ts: float, episode_ids: list[EpisodeId]
    ) -> dict[str, Any]:
        """Mark the attempts (and earlier ones) retired on every worker, stop their work and
        free their state, live or restored; in `idle` or `restored`. The marks stay until
        `forget`, whether or not this finishes."""
        async with self._lock:
            self.machine.check("retire", checkpoint_id, deadline_ts, self.clock())
            if self.machine.is_open:
                self.machine.extend(deadline_ts)
            self.marks.retire(episode_ids)
            self.claims.drop_retired(self.marks)  # those rollouts start over as later attempts
            retire = Retire([EpisodeRef(e.rollout_id, e.attempt) for e in episode_ids])
            await self._gather(self.workers.live(), retire, deadline_ts)
            return {"retired": [e.key for e in episode_ids]}

    async def forget(
        self, checkpoint_id: str, deadline_ts: float, rollout_ids: list[str]
    ) -> dict[str, Any]:
        """Stop refusing these rollouts' retired attempts, on every worker."""
        async with self._lock:
            self.machine.check("forget", checkpoint_id, deadline_ts, self.clock())
            if self.machine.is_open:
                self.machine.extend(deadline_ts)
            await self._gather(self.workers.live(), Forget(sorted(set(rollout_ids))), deadline_ts)
            self.marks.forget(rollout_ids)
            return {"forgotten": sorted(set(rollout_ids))}

    async def watch_lease(self) -> None:
        """Resume a checkpoint whose lease ran out, looked at every LEASE_CHECK seconds
        (a task of its own: a resume may wait its turn behind a commit)."""
        while True:
            await asyncio.sleep(LEASE_CHECK)
            if self.machine.lease_expired(self.clock()):
                await self.expire_lease()

    async def expire_lease(self) -> bool:
        """Resume by itself when the lease ran out; True if it did."""
        checkpoint_id = self.machine.checkpoint_id
        if checkpoint_id is None or not self.machine.lease_expired(self.clock()):
            return False
        await self._stop_work(checkpoint_id)
        async with self._lock:
            if not self.machine.lease_expired(self.clock()):
                return False
            log.warning("checkpoint %s outlived its lease; resuming", self.machine.checkpoint_id)
            await self._reopen()
            return True

    # ---- helpers ------------------------------------------------------------------
    async def _exclusive(
        self, checkpoint_id: str, operation: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """Run one operation under the lock, as a task a resume of its checkpoint cancels."""
        async with self._lock:
            task = asyncio.ensure_future(operation())
            self._op = (checkpoint_id, task)
            try:
                return await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if task.cancelled() and current is not None and not current.cancelling():
                    raise GymError(
                        "stale_checkpoint", "the checkpoint was resumed while this call ran"
                    ) from None
                raise
            finally:
                self._op = None

    def _remaining(self, deadline_ts: float, what: str) -> float:
        left = deadline_ts - self.clock()
        if left <= 0:
            raise GymError("deadline_exceeded", f"deadline_ts passed before {what}")
        return left

    def _kind(self) -> str:
        if self.kind is None:
            raise GymError("invalid_phase", "no worker has registered yet")
        return self.kind

    def _tables(self) -> Tables:
        return Tables(self.claims.attempts(), self.marks.as_dict())

    async def _gather(
        self,
        live: list[LiveWorker],
        message: Request[R] | Callable[[LiveWorker], Request[R]],
        deadline_ts: float,
    ) -> list[R]:
        """Send `message` (or the one `message(worker)` makes for it) to every worker in
        `live` at once; any failure refuses the whole call."""
        if not live:
            return []
        if callable(message):  # each made once: an Install carries megabytes of records
            made = {id(worker): message(worker) for worker in live}
            what = made[id(live[0])].TYPE
            message = lambda worker: made[id(worker)]  # noqa: E731
        else:
            what = message.TYPE
        answered = await broadcast(live, message, self._remaining(deadline_ts, what))
        replies = []
        for worker, result in answered:
            if isinstance(result, ChannelTimeout):
                raise GymError(
                    "deadline_exceeded",
                    f"worker {worker.slot} did not answer {what} by deadline_ts",
                )
            if isinstance(result, ChannelClosed):
                raise GymError("invalid_phase", f"worker {worker.slot} was lost during {what}")
            if isinstance(result, RemoteError):
                raise GymError(result.code, f"{what} on worker {worker.slot}: {result.detail}")
            if isinstance(result, BaseException):
                raise result
            replies.append(result)
        return replies


def _succeeded(task: asyncio.Future[Any]) -> bool:
    return not task.cancelled() and task.exception() is None


def _retrieve(task: asyncio.Future[Any]) -> None:
    """A write nobody awaits any more (its commit timed out) must not log 'never retrieved'."""
    if not task.cancelled():
        task.exception()


@dataclass
class _Selection:
    """What a restore continues: each session record as placement and its worker need it
    (`owner`, `session_id`, its `line` as the records file holds it, the line's `number`
    and the `identity` the worker checks it against), the episode records in scope, and
    the capture keys the bound sessions continue as."""

    sessions: list[dict[str, Any]]
    episodes: list[dict[str, Any]]
    continued: set[str]


def _select(records: list[dict[str, Any]], lines: list[bytes], scope: set[str]) -> _Selection:
    """Records a restore continues: sessions bound to no episode, and what `scope` lists;
    bound sessions continue as the next attempt (the worker moves them, `continuing`;
    episodes move when claimed)."""
    selection = _Selection([], [], set())
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
    """The Install of a worker's placed sessions: their lines, joined, and what the worker
    checks each against."""
    return Install(
        b"\n".join([*(s["line"] for s in sessions), b""]),  # one copy, each line ended
        [s["identity"] for s in sessions],
        [s["number"] for s in sessions],
        source,
    )


def _size(checkpoint_dir: str, kind: str, instance: str, manifest: dict[str, Any]) -> int:
    """The size of a checkpoint's records file (0 if it cannot be read now)."""
    records_file: str = manifest["records_file"]
    path = files.checkpoint_path(checkpoint_dir, kind, instance) / records_file
    try:
        return path.stat().st_size
    except OSError:
        return 0
