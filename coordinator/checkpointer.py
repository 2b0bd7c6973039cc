"""The checkpointer, the coordinator the proxy hosts: N workers as one checkpoint participant.

It drives the phase machine (`coordinator.phases`), talks to every worker over its
channel, has the commit's files written (`coordinator.commit_write`, in a thread),
restores (`coordinator.restore`: read, placed, installed, or rolled back) and holds
restored episode records until exactly one worker claims each.

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
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from gym_proxy.coordinator import checkpoint_files as files
from gym_proxy.coordinator.broadcast import all_answer, broadcast
from gym_proxy.coordinator.commit_write import CheckpointIO, CommitWrite, exported, extras
from gym_proxy.coordinator.contract.answers import (
    NOT_OPEN,
    CommitAnswer,
    ForgetAnswer,
    Manifest,
    PrepareAnswer,
    ReadinessReport,
    RenewAnswer,
    RestoreAnswer,
    ResumeAnswer,
    RetireAnswer,
    ServerStatus,
    WorkerStatus,
)
from gym_proxy.coordinator.contract.channel import Channel
from gym_proxy.coordinator.contract.episodes import EpisodeId
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.marks import RestoredClaims, RetireMarks
from gym_proxy.coordinator.contract.messages import (
    Claim,
    Close,
    CloseReply,
    EpisodeRef,
    Export,
    Forget,
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
)
from gym_proxy.coordinator.exclusion import Exclusion
from gym_proxy.coordinator.phases import PhaseMachine
from gym_proxy.coordinator.readiness import Readiness
from gym_proxy.coordinator.restore import REOPEN_WAIT, Restore

__all__ = ["LiveWorker", "Workers", "SessionTables", "Checkpointer", "CheckpointIO"]

log = logging.getLogger("gym_proxy.coordinator")
R = TypeVar("R", bound=Message)
A = TypeVar("A", bound=Message)

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
    # Shared with the moves and live operations: the machine tells it of each checkpoint.
    exclusion: Exclusion = field(default_factory=Exclusion)
    restorer: Restore = field(init=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _op: tuple[str, asyncio.Task[Any]] | None = None
    _write: CommitWrite | None = None
    _sends: set[asyncio.Future[CloseReply]] = field(default_factory=set)
    io: CheckpointIO = field(default_factory=CheckpointIO)
    _warned_restart_only: bool = False

    def __post_init__(self) -> None:
        exclusion = self.exclusion
        self.machine = PhaseMachine(
            self.lease_grace,
            on_open=exclusion.checkpoint_opened,
            on_idle=exclusion.checkpoint_closed,
        )
        self.restorer = Restore(self)

    # ---- worker side ------------------------------------------------------------
    def register_reply(self, registration: Register) -> RegisterReply:
        """What a (late) joining worker needs: pending claims, marks, an open checkpoint.
        A worker a dead instance left brings the marks it enforces (marks only grow)."""
        if self.kind is None:
            self.kind = registration.kind
        if registration.restart_only and not self._warned_restart_only:
            self._warned_restart_only = True
            _warn_restart_only(self.instance)
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
                return self.restorer.claim(message)
        raise GymError("invalid_request", f"{message.TYPE} is not a message for the coordinator")

    # ---- control operations -------------------------------------------------------
    def status(self) -> ServerStatus:
        """The participant's status (the proxy adds the fleet's: `proxy.control`)."""
        live = self.workers.live()
        ready = self.readiness.worker_ready
        return ServerStatus(
            kind=self.kind,
            instance=self.instance,
            phase=self.machine.phase,
            checkpoint_id=self.machine.checkpoint_id,
            lease_expires_at=self.machine.lease_expires_at,
            report=self._report(live),
            retired_rollouts=len(self.marks),
            restored_pending=self.claims.keys(),
            workers=[
                WorkerStatus(w.slot, w.owner, w.pid, w.in_flight, ready(w.owner)) for w in live
            ],
            expected_workers=self.workers.expected,
            session_aliases=dict(self.tables.aliases),
            routed_sessions=len(self.tables.sessions) + len(self.tables.app_sessions),
            operation=self.exclusion.operation,
            last_commit=self.io.last_commit,
            last_restore=self.io.last_restore,
        )

    def _report(self, live: list[LiveWorker] | None = None) -> ReadinessReport:
        if not self.machine.is_open:
            return NOT_OPEN
        return self.readiness.report(
            live or self.workers.live(), self.workers.expected, self.kind or "resources"
        )

    @property
    def open_checkpoint(self) -> str | None:
        """The ID of the checkpoint that is open, if one is."""
        return self.machine.checkpoint_id if self.machine.is_open else None

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> PrepareAnswer:
        async with self._lock:
            cached = self.machine.check("prepare", checkpoint_id, deadline_ts, self.clock())
            if cached is not None:
                return _as(PrepareAnswer, cached)
            await self.exclusion.admit_checkpoint()
            if not self.machine.is_open:
                self.machine.open(checkpoint_id, "preparing", deadline_ts)
                self.readiness.reset()
                self._send_close(checkpoint_id, deadline_ts)
            else:
                self.machine.extend(deadline_ts)
        await self.readiness.wait_ready(
            lambda: self._report().ready or self.machine.checkpoint_id != checkpoint_id,
            deadline_ts - self.clock(),
        )
        async with self._lock:
            if self.machine.checkpoint_id != checkpoint_id:
                raise GymError("stale_checkpoint", "the checkpoint was resumed")
            if "prepare" in self.machine.replies:
                return _as(PrepareAnswer, self.machine.replies["prepare"][1])
            report = self._report()
            if not report.ready:
                return PrepareAnswer("preparing", report)
            return self.machine.succeed("prepare", "prepared", PrepareAnswer("prepared", report))

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
    ) -> CommitAnswer:
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
    ) -> CommitAnswer:
        scope = None if episode_ids is None else tuple(sorted({e.key for e in episode_ids}))
        arguments = (checkpoint_dir, scope)
        cached = self.machine.check("commit", checkpoint_id, deadline_ts, self.clock(), arguments)
        if cached is not None:
            return _as(CommitAnswer, cached)
        self.machine.extend(deadline_ts)  # the lease covers the call's own deadline
        live = self.workers.live()
        write = self._write
        if write is not None and write.failed:
            write = self._write = None  # this retry exports again
        if write is None:
            report = self._report(live)
            if not report.ready:
                blockers = ", ".join(report.blockers[:5])
                raise GymError("invalid_phase", f"participant is no longer ready: {blockers}")
            restarted = sorted(set(report.restarts) & set(scope or ()))
            if restarted:
                # This participant holds none of a restart's state: continuing it would
                # resume a rollout whose other parts start over.
                raise GymError("restart_in_scope", f"the scope names restarts: {restarted}")
            write = await self._start_write(checkpoint_id, checkpoint_dir, scope, live, deadline_ts)
        elif write.target != (checkpoint_dir, scope):
            raise GymError(
                "checkpoint_conflict", "a retried commit must name the same directory and scope"
            )
        manifest = await write.manifest(self.remaining(deadline_ts, "the checkpoint write"))
        write.count(self.io, manifest)
        if scope is not None:
            keep = set(scope)
            await self.gather(live, Release(sorted(keep)), deadline_ts)
            self.claims.keep_only(keep)
        if stop:
            await self._stop_workers(live, deadline_ts)
        answer = CommitAnswer("committed", Manifest.decode(manifest), sorted(write.keys))
        write.answered = True
        self.io.done("commit", checkpoint_id, manifest["record_count"])
        return self.machine.succeed("commit", "committed", answer, arguments)

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
    ) -> CommitWrite:
        """Export every worker's records, then write them in a thread (commit_write)."""
        kind = self.kind_named()
        export = Export(checkpoint_id, None if scope is None else list(scope), kind)
        replies = await self.gather(live, export, deadline_ts)
        base = files.checkpoint_path(checkpoint_dir, kind, self.instance)
        self._write = CommitWrite.start(
            checkpoint_id, (checkpoint_dir, scope), base, kind, self.instance,
            exported(replies, self.claims, scope), extras(self.tables, live),
        )  # fmt: skip
        return self._write

    async def restore(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId],
    ) -> RestoreAnswer:
        return await self._exclusive(
            checkpoint_id,
            lambda: self.restorer.run(checkpoint_id, deadline_ts, checkpoint_dir, episode_ids),
        )

    async def recover_claims(self) -> None:
        """After an adoption: the restored episodes the adopted workers still expect
        (`coordinator.restore`)."""
        expected, self._expected_by_adopted = self._expected_by_adopted, []
        await self.restorer.recover_claims(expected)

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> RenewAnswer:
        # Never behind the lock: only the lease moves.
        self.machine.check("renew", checkpoint_id, deadline_ts, self.clock())
        self.machine.extend(deadline_ts)
        return RenewAnswer(self.machine.lease_expires_at, self.machine.phase)

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> ResumeAnswer:
        if checkpoint_id in self.machine.resumed:  # never behind another call
            return ResumeAnswer("idle", True)
        stopped = False
        if self.machine.checkpoint_id == checkpoint_id:
            stopped = await self._stop_work(checkpoint_id)
        async with self._lock:
            if stopped and not self.machine.is_open:
                # It stopped a restore, whose rollback left the participant idle: this
                # resume did something, and its ID is fenced like any resumed one.
                self.machine.remember(checkpoint_id)
                return ResumeAnswer("idle", False)
            cached = self.machine.check("resume", checkpoint_id, deadline_ts, self.clock())
            if cached is not None:
                return _as(ResumeAnswer, cached)
            await self._reopen()
            return ResumeAnswer("idle", False)

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
            await write.stop()
        return stopped

    async def _reopen(self) -> None:
        write = self._write
        if write is not None:
            await write.stop()
            self._write = None
        self.machine.close()
        self.readiness.reset()
        for worker, result in await broadcast(self.workers.live(), Reopen(), REOPEN_WAIT):
            if isinstance(result, BaseException):
                log.warning("reopen of worker %d failed: %s", worker.slot, result)

    async def retire(
        self, checkpoint_id: str, deadline_ts: float, episode_ids: list[EpisodeId]
    ) -> RetireAnswer:
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
            await self.gather(self.workers.live(), retire, deadline_ts)
            return RetireAnswer([e.key for e in episode_ids])

    async def forget(
        self, checkpoint_id: str, deadline_ts: float, rollout_ids: list[str]
    ) -> ForgetAnswer:
        """Stop refusing these rollouts' retired attempts, on every worker."""
        async with self._lock:
            self.machine.check("forget", checkpoint_id, deadline_ts, self.clock())
            if self.machine.is_open:
                self.machine.extend(deadline_ts)
            await self.gather(self.workers.live(), Forget(sorted(set(rollout_ids))), deadline_ts)
            self.marks.forget(rollout_ids)
            return ForgetAnswer(sorted(set(rollout_ids)))

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
    async def _exclusive(self, checkpoint_id: str, operation: Callable[[], Awaitable[A]]) -> A:
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

    def remaining(self, deadline_ts: float, what: str) -> float:
        """Seconds left until `deadline_ts`; deadline_exceeded once none are (`what` is
        the step that would start)."""
        left = deadline_ts - self.clock()
        if left <= 0:
            raise GymError("deadline_exceeded", f"deadline_ts passed before {what}")
        return left

    def kind_named(self) -> str:
        """The participant's kind, as the first worker named it."""
        if self.kind is None:
            raise GymError("invalid_phase", "no worker has registered yet")
        return self.kind

    def _tables(self) -> Tables:
        return Tables(self.claims.attempts(), self.marks.as_dict())

    async def gather(
        self,
        live: list[LiveWorker],
        message: Request[R] | Callable[[LiveWorker], Request[R]],
        deadline_ts: float,
    ) -> list[R]:
        """Every worker of `live` answers `message` by `deadline_ts`, or the call fails
        naming the first that did not (`broadcast.all_answer`)."""
        what = "the install" if callable(message) else message.TYPE
        return await all_answer(live, message, self.remaining(deadline_ts, what))


def _warn_restart_only(instance: str) -> None:
    log.warning(
        "%s declares no session state, so it is a restart-only participant: a "
        "checkpoint exports none of its sessions and names the rollouts using them "
        "as restarts (declare a session dict, hooks or the session store to export "
        "them: docs/nemo_gym.md, 'State without code')",
        instance,
    )


def _as(answer: type[A], cached: Message) -> A:
    """A cached answer, as the call it was cached for answers it."""
    if not isinstance(cached, answer):
        raise TypeError(f"a cached {type(cached).__name__} where {answer.__name__} is due")
    return cached
