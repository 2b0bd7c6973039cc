"""The coordinator: N workers as one checkpoint participant.

It drives the phase machine (`coordinator.phases`), talks to every worker over its
channel, writes and verifies checkpoint files (`coordinator.records`), places restored
sessions (`coordinator.placement`) and holds restored episode records until exactly one
worker claims each. Control operations run one at a time under a lock, except the wait
of `prepare` for readiness, which a `resume` may cut short.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from coordinator import records as files
from coordinator.channel import Channel, ChannelClosed, RemoteError
from coordinator.episode_ids import EpisodeId, parse_episode_key
from coordinator.phases import ControlError, PhaseMachine
from coordinator.placement import place
from coordinator.reports import Readiness

__all__ = ["LiveWorker", "WorkerView", "Checkpointer"]

log = logging.getLogger("gym_proxy.coordinator")


@dataclass(frozen=True)
class LiveWorker:
    slot: int
    owner: str
    pid: int
    channel: Channel
    in_flight: int


class WorkerView(Protocol):
    """What the coordinator needs from the supervisor and the router."""

    expected: int

    def live(self) -> list[LiveWorker]: ...

    def aliases(self) -> dict[str, str]: ...

    def placed_sessions(self) -> dict[str, str]: ...

    def set_tables(self, aliases: dict[str, str], sessions: dict[str, str]) -> None: ...


@dataclass(eq=False)
class Checkpointer:
    workers: WorkerView
    instance: str
    lease_grace: float
    clock: Callable[[], float] = time.time
    kind: str | None = None
    machine: PhaseMachine = field(init=False)
    readiness: Readiness = field(default_factory=Readiness)
    pending: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    restored_once: bool = False
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.machine = PhaseMachine(self.lease_grace)

    # ---- worker side ------------------------------------------------------------
    def register_reply(self, kind: str) -> dict[str, Any]:
        """What a (late) joining worker needs: tables, pending claims, open checkpoint."""
        if self.kind is None:
            self.kind = kind
        reply: dict[str, Any] = {"tables": self._tables()}
        if self.machine.is_open:
            reply["checkpoint_id"] = self.machine.checkpoint_id
        return reply

    def on_lost(self, owner: str) -> None:
        self.readiness.forget(owner, lost_while_open=self.machine.is_open)
        self.machine.unprepare()

    async def on_message(self, owner: str, message: dict[str, Any]) -> dict[str, Any] | None:
        kind = message["type"]
        if kind == "ready":
            if message.get("checkpoint_id") == self.machine.checkpoint_id:
                self.readiness.update(owner, message)
            return None
        if kind == "claim":
            return self._claim(message)
        raise ValueError(f"unknown message type {kind!r}")

    def _claim(self, message: dict[str, Any]) -> dict[str, Any]:
        # Synchronous on purpose: the reply is written before any later message.
        if self.machine.is_open:
            raise ValueError("checkpoint_parked: claims wait until the checkpoint resumes")
        rollout_id, attempt = str(message["rollout_id"]), int(message["attempt"])
        held = self.pending.get(rollout_id)
        if held is None:
            raise ValueError(f"stale_attempt: {rollout_id} has no unclaimed restored record")
        if held[0] != attempt:
            raise ValueError(f"stale_attempt: {rollout_id} continues only as attempt {held[0]}")
        del self.pending[rollout_id]
        return {"state": held[1].get("state")}

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
            "session_aliases": self.workers.aliases(),
            "restored_pending": len(self.pending),
        }

    def _report(self, live: list[LiveWorker] | None = None) -> dict[str, Any]:
        if not self.machine.is_open:
            return {"ready": False, "blockers": [], "blocker_count": 0, "counts": {}}
        return self.readiness.report(live or self.workers.live(), self.workers.expected)

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        async with self._lock:
            cached = self.machine.check("prepare", checkpoint_id, deadline_ts, self.clock())
            if cached is not None:
                return cached
            if not self.machine.is_open:
                self.machine.open(checkpoint_id, "preparing", deadline_ts)
                self.readiness.reset()
                for owner, reply in await self._broadcast("close", checkpoint_id=checkpoint_id):
                    self.readiness.update(owner, reply["report"])
            else:
                self.machine.extend(deadline_ts)
        await self.readiness.wait_ready(
            lambda: self._report()["ready"] or self.machine.checkpoint_id != checkpoint_id,
            deadline_ts - self.clock(),
        )
        async with self._lock:
            if self.machine.checkpoint_id != checkpoint_id:
                raise ControlError(409, "stale_checkpoint", "the checkpoint was resumed")
            if "prepare" in self.machine.replies:
                return self.machine.replies["prepare"]
            report = self._report()
            if not report["ready"]:
                return {"phase": "preparing", "report": report}
            return self.machine.succeed(
                "prepare", "prepared", {"phase": "prepared", "report": report}
            )

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId] | None,
    ) -> dict[str, Any]:
        async with self._lock:
            cached = self.machine.check("commit", checkpoint_id, deadline_ts, self.clock())
            if cached is not None:
                return cached
            live = self.workers.live()
            report = self._report(live)
            if not report["ready"]:
                blockers = ", ".join(report["blockers"][:5])
                raise ControlError(409, "invalid_phase", f"participant is not ready: {blockers}")
            scope = None if episode_ids is None else sorted({e.key for e in episode_ids})
            replies = await self._gather(live, "export", checkpoint_id=checkpoint_id, scope=scope)
            records = [r for reply in replies for r in reply["records"]]
            keep = None if scope is None else set(scope)
            for rollout_id, (attempt, record) in list(self.pending.items()):
                if keep is None or EpisodeId(rollout_id, attempt).key in keep:
                    records.append({**record, "attempt": attempt})
            owners = {w.owner for w in live}
            session_owners = {o: o for o in owners}
            session_owners.update(
                {old: new for old, new in self.workers.aliases().items() if new in owners}
            )
            placed = {s: o for s, o in self.workers.placed_sessions().items() if o in owners}
            base = files.checkpoint_path(checkpoint_dir, self._kind(), self.instance)
            try:
                manifest = await asyncio.to_thread(
                    files.write,
                    base,
                    kind=self._kind(),
                    instance=self.instance,
                    checkpoint_id=checkpoint_id,
                    records=records,
                    session_owners=session_owners,
                    placed_sessions=placed,
                )
            except files.InvalidCheckpoint as exc:
                raise ControlError(409, "invalid_checkpoint_state", str(exc)) from exc
            except OSError as exc:
                raise ControlError(500, "checkpoint_write_failed", str(exc)) from exc
            if keep is not None:
                await self._gather(live, "release", keep=sorted(keep))
                for rollout_id, (attempt, _) in list(self.pending.items()):
                    if EpisodeId(rollout_id, attempt).key not in keep:
                        del self.pending[rollout_id]
            exported = [
                {"rollout_id": r["rollout_id"], "attempt": r["attempt"]}
                for r in records
                if r["type"] == "episode"
            ]
            return self.machine.succeed(
                "commit",
                "committed",
                {"phase": "committed", "manifest": manifest, "episode_ids": exported},
            )

    async def restore(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId],
    ) -> dict[str, Any]:
        async with self._lock:
            cached = self.machine.check("restore", checkpoint_id, deadline_ts, self.clock())
            if cached is not None:
                return cached
            if self.restored_once:
                raise ControlError(409, "invalid_phase", "restore needs freshly started workers")
            live = self.workers.live()
            if len(live) < self.workers.expected:
                raise ControlError(
                    409,
                    "invalid_phase",
                    f"workers-unreported:{self.workers.expected - len(live)}",
                )
            base = files.checkpoint_path(checkpoint_dir, self._kind(), self.instance)
            try:
                manifest, records = await asyncio.to_thread(
                    files.read, base, kind=self._kind(), instance=self.instance
                )
            except files.InvalidCheckpoint as exc:
                raise ControlError(422, "invalid_checkpoint_state", str(exc)) from exc
            sessions, episodes = _select(records, {e.key for e in episode_ids})
            placement = place(
                sessions,
                manifest["session_owners"],
                manifest["placed_sessions"],
                [w.owner for w in live],
            )
            pending = {r["rollout_id"]: (r["attempt"] + 1, r) for r in episodes}
            self.machine.open(checkpoint_id, "restored", deadline_ts)
            self.readiness.reset()
            tables = {
                "aliases": placement.aliases,
                "sessions": placement.sessions,
                "pending": {rid: attempt for rid, (attempt, _) in pending.items()},
            }
            try:
                await self._gather(live, "close", checkpoint_id=checkpoint_id)
                await self._gather(
                    live, "install", lambda w: {"sessions": placement.records[w.owner]}
                )
                await self._gather(live, "tables", **tables)
            except ControlError as exc:
                await self._rollback(live)
                detail = f"{exc.detail}; nothing was installed"
                raise ControlError(exc.status, exc.code, detail) from exc
            self.workers.set_tables(placement.aliases, placement.sessions)
            self.pending = pending
            self.restored_once = True
            reply = {
                "phase": "restored",
                "source_checkpoint_id": manifest["checkpoint_id"],
                "restored": sorted(EpisodeId(rid, a).key for rid, (a, _) in pending.items()),
            }
            return self.machine.succeed("restore", "restored", reply)

    async def _rollback(self, live: list[LiveWorker]) -> None:
        empty = {"aliases": {}, "sessions": {}, "pending": {}}
        for worker in live:
            for message, fields in (("uninstall", {}), ("tables", empty), ("reopen", {})):
                try:
                    await worker.channel.request(message, **fields)
                except (ChannelClosed, RemoteError):
                    pass
        self.machine.abandon()

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        async with self._lock:
            self.machine.check("renew", checkpoint_id, deadline_ts, self.clock())
            self.machine.extend(deadline_ts)
            return {"phase": self.machine.phase, "lease_expires_at": self.machine.lease_expires_at}

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        async with self._lock:
            cached = self.machine.check("resume", checkpoint_id, deadline_ts, self.clock())
            if cached is not None:
                return cached
            await self._reopen()
            return {"phase": "idle", "idempotent": False}

    async def _reopen(self) -> None:
        self.machine.close()
        self.readiness.reset()
        await self._broadcast("reopen")

    async def retire(
        self, checkpoint_id: str, deadline_ts: float, episode_ids: list[EpisodeId]
    ) -> dict[str, Any]:
        async with self._lock:
            if self.machine.is_open:
                raise ControlError(
                    409, "invalid_phase", "retire is refused while a checkpoint is open"
                )
            if deadline_ts <= self.clock():
                raise ControlError(409, "deadline_exceeded", "deadline_ts is already in the past")
            keys = sorted({e.key for e in episode_ids})
            await self._gather(self.workers.live(), "retire", episodes=keys)
            for episode in episode_ids:
                held = self.pending.get(episode.rollout_id)
                if held is not None and held[0] == episode.attempt:
                    del self.pending[episode.rollout_id]
            return {"retired": keys}

    async def expire_lease(self) -> bool:
        """Resume by itself when the lease ran out; True if it did."""
        async with self._lock:
            if not self.machine.lease_expired(self.clock()):
                return False
            log.warning("checkpoint %s outlived its lease; resuming", self.machine.checkpoint_id)
            await self._reopen()
            return True

    # ---- helpers ------------------------------------------------------------------
    def _kind(self) -> str:
        if self.kind is None:
            raise ControlError(409, "invalid_phase", "no worker has registered yet")
        return self.kind

    def _tables(self) -> dict[str, Any]:
        return {
            "aliases": self.workers.aliases(),
            "sessions": self.workers.placed_sessions(),
            "pending": {rid: attempt for rid, (attempt, _) in self.pending.items()},
        }

    async def _broadcast(self, message: str, **fields: Any) -> list[tuple[str, dict]]:
        """Send to every live worker; one that fails shows up as lost, not as an error."""
        live = self.workers.live()
        results = await asyncio.gather(
            *(w.channel.request(message, **fields) for w in live), return_exceptions=True
        )
        replies = []
        for worker, result in zip(live, results, strict=True):
            if isinstance(result, ChannelClosed | RemoteError):
                log.warning("%s to worker %d failed: %s", message, worker.slot, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                replies.append((worker.owner, result))
        return replies

    async def _gather(
        self,
        live: list[LiveWorker],
        message: str,
        per_worker: Callable[[LiveWorker], dict[str, Any]] | None = None,
        **fields: Any,
    ) -> list[dict]:
        """Send to every worker in `live` at once; any failure refuses the whole call."""
        requests = [
            w.channel.request(message, **fields, **(per_worker(w) if per_worker else {}))
            for w in live
        ]
        try:
            return list(await asyncio.gather(*requests))
        except (ChannelClosed, RemoteError) as exc:
            raise ControlError(
                409, "invalid_phase", f"{message} failed on a worker: {exc}"
            ) from exc


def _select(
    records: list[dict[str, Any]], scope: set[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Records a restore continues: unbound sessions, and what `scope` lists, at attempt+1."""
    sessions, episodes = [], []
    for record in records:
        if record["type"] == "episode":
            if EpisodeId(record["rollout_id"], record["attempt"]).key in scope:
                episodes.append(record)
            continue
        bound = record.get("episode")
        if bound is None:
            sessions.append(record)
        elif bound in scope:
            sessions.append({**record, "episode": parse_episode_key(bound).next_attempt().key})
    return sessions, episodes
