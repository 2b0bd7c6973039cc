"""A checkpoint controller: drives participants over their control plane, in NeMo Gym's
order (`nemo_gym/_checkpoint/coordination.py`), so gym-proxy servers and NeMo Gym
servers can be driven together.

- `prepare` runs in stages: environment, model, agent, resources; each stage fans out at
  once, and it stops at the first stage that is not prepared (`PrepareResult`).
- `commit` and `restore` fan out to every participant at once. A restore that fails
  anywhere retires the attempts it would continue (N+1) everywhere, resumes everywhere,
  then raises: nothing continues from a partial restore.
- `resume` runs the stages in reverse and keeps going past failures.
- `retire` and `forget` run callers before callees: environment, agent, then model and
  resources together.
- `checkpoint` is prepare, commit, resume; with `stragglers="retire"`, a prepare that
  misses its deadline resumes, retires its blocking episodes (bare capture keys), and
  prepares again once. It answers a `CheckpointResult`: the commit replies, and by
  participant the episodes it named in `report.restarts` (left out of the commit scope;
  the controller starts them over after a crash), so a partial checkpoint says it is one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson

from gym_proxy.coordinator.clients.checkpoint_result import CheckpointResult
from gym_proxy.coordinator.contract.answers import (
    AnswerError,
    CommitAnswer,
    ForgetAnswer,
    MoveAnswer,
    OperationReport,
    PrepareAnswer,
    RenewAnswer,
    RestoreAnswer,
    ResumeAnswer,
    RetireAnswer,
    ServerStatus,
    read_answer,
)
from gym_proxy.coordinator.contract.episodes import EpisodeId, parse_episode_key
from gym_proxy.coordinator.contract.headers import CHECKPOINT_PATH, MOVE_PATH, WORKERS_PATH
from gym_proxy.coordinator.contract.messages import Message

__all__ = [
    "CheckpointResult",
    "KIND_ORDER",
    "RETIRE_ORDER",
    "ControlFailed",
    "Participant",
    "PrepareResult",
    "Controller",
    "in_call_order",
]

A = TypeVar("A", bound=Message)
# What each checkpoint call answers (`coordinator.contract.answers`).
ANSWERS: dict[str, type[Message]] = {
    "prepare": PrepareAnswer,
    "commit": CommitAnswer,
    "restore": RestoreAnswer,
    "resume": ResumeAnswer,
    "renew": RenewAnswer,
    "retire": RetireAnswer,
    "forget": ForgetAnswer,
    "status": ServerStatus,
}
KIND_ORDER = ("environment", "model", "agent", "resources")
RETIRE_ORDER = (("environment",), ("agent",), ("model", "resources"))
RESTORE_CLEANUP_SECONDS = 30.0
REPLY_SLACK = 5.0  # a participant bounds its work by deadline_ts; this covers the reply


class ControlFailed(Exception):
    """Participants refused a control call (or could not be reached)."""

    def __init__(self, operation: str, failures: dict[str, tuple[int, str, str]]) -> None:
        detail = "; ".join(
            f"{url}: {status} {code}: {text}"
            for url, (status, code, text) in sorted(failures.items())
        )
        super().__init__(f"{operation} failed on {len(failures)} participant(s): {detail}")
        self.operation = operation
        self.failures = failures

    @property
    def codes(self) -> set[str]:
        return {code for _, code, _ in self.failures.values()}


@dataclass
class Participant:
    """One server's control plane (a gym-proxy, or any NeMo Gym participant)."""

    url: str
    token: str
    http: aiohttp.ClientSession
    kind: str = "resources"

    async def call(
        self, op: str, answer: type[A], deadline_ts: float | None = None, **body: Any
    ) -> A:
        """One checkpoint control call, answered as `answer` (`ANSWERS[op]`); ControlFailed
        on anything but 200 and an answer of that shape."""
        within = None if deadline_ts is None else max(0.0, deadline_ts - time.time()) + REPLY_SLACK
        if op == "status":
            path, method, payload = f"{CHECKPOINT_PATH}/status", "GET", None
        else:
            path, method = f"{CHECKPOINT_PATH}/{op}", "POST"
            payload = {"deadline_ts": deadline_ts, **body}
        return self._answer(op, answer, await self._request(op, method, path, payload, within))

    async def status(self) -> ServerStatus:
        return await self.call("status", ServerStatus)

    async def move_sessions(
        self, session_ids: list[str], to_slot: int, timeout_s: float = 30.0
    ) -> MoveAnswer:
        """Move live sessions of a gym-proxy to the worker in `to_slot` (its answer:
        `moved`, `failed` with reasons); ControlFailed on anything but 200."""
        body = {"session_ids": session_ids, "to_slot": to_slot, "timeout_s": timeout_s}
        reply = await self._request("move", "POST", MOVE_PATH, body, timeout_s + REPLY_SLACK)
        return self._answer("move", MoveAnswer, reply)

    async def operate(self, operation: str, body: dict[str, Any]) -> OperationReport:
        """Run a live operation of a gym-proxy (`drain`, `undrain`, `restart`, `resize`)
        and answer its report; ControlFailed on anything but 200. Not bounded here: the
        server bounds every step (`timeout_s` per worker emptied, its boot timeout per
        worker started), and a restart of many slots takes as many steps."""
        path = f"{WORKERS_PATH}/{operation}"
        reply = await self._request(operation, "POST", path, body, None)
        return self._answer(operation, OperationReport, reply)

    def _answer(self, op: str, answer: type[A], reply: dict[str, object]) -> A:
        """The reply read as `answer` (what another participant adds is left out); a reply
        of another shape is this participant's failure like any other."""
        try:
            return read_answer(answer, reply, op)
        except AnswerError as exc:
            raise ControlFailed(op, {self.url: (200, "invalid_reply", str(exc))}) from None

    async def _request(
        self, op: str, method: str, path: str, body: dict[str, Any] | None, within: float | None
    ) -> dict[str, object]:
        headers = {"Authorization": f"Bearer {self.token}"}
        url = f"{self.url.rstrip('/')}{path}"
        # orjson, not aiohttp's json=: a restore names every episode in flight to each
        # participant (8,000: 3.9 ms a body with the standard library's encoder, 0.4).
        data = None
        if body is not None:
            data = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        try:
            async with asyncio.timeout(within):
                async with self.http.request(method, url, data=data, headers=headers) as resp:
                    raw = await resp.read()
                    status = resp.status
            reply: Any = orjson.loads(raw) if raw.strip() else None
        except (aiohttp.ClientError, ValueError, TimeoutError) as exc:
            raise ControlFailed(
                op, {self.url: (0, "unreachable", str(exc) or "timed out")}
            ) from exc
        if status != 200:
            error = reply.get("error", {}) if isinstance(reply, dict) else {}
            failure = (status, error.get("code", "?"), error.get("detail", ""))
            raise ControlFailed(op, {self.url: failure})
        if not isinstance(reply, dict):
            # A participant's failure like any other: the callers read the reply's keys, and
            # a restore or a checkpoint cleans up after a ControlFailed only.
            detail = f"a 200 reply that is not a JSON object: {raw[:200]!r}"
            raise ControlFailed(op, {self.url: (status, "invalid_reply", detail)})
        return reply

    async def learn_kind(self) -> str:
        self.kind = (await self.status()).kind or "resources"
        return self.kind


def in_call_order(participants: list[Participant]) -> list[Participant]:
    """Callers before callees: environment, model, agent, resources (others last)."""
    rank = {kind: i for i, kind in enumerate(KIND_ORDER)}
    return sorted(participants, key=lambda p: rank.get(p.kind, len(KIND_ORDER)))


@dataclass(frozen=True)
class PrepareResult:
    """Whether every participant is prepared; if not, what the unprepared ones wait for."""

    prepared: bool
    replies: dict[str, PrepareAnswer]

    def blockers(self) -> dict[str, list[str]]:
        return {
            url: reply.report.blockers
            for url, reply in self.replies.items()
            if reply.phase != "prepared"
        }

    def blocking_episodes(self) -> list[EpisodeId]:
        """The blockers that name episodes (bare capture keys), for a straggler retire;
        markers such as `resources-worker-lost` and `session:<id>` are not episodes."""
        keys = {
            key
            for blockers in self.blockers().values()
            for key in blockers
            if ":" not in key and not key.endswith("-worker-lost")
        }
        return [parse_episode_key(key) for key in sorted(keys)]

    def restarts(self) -> set[str]:
        """Episodes some participant cannot capture: a rollout restarts if any part does."""
        return {key for r in self.replies.values() for key in r.report.restarts}

    def restarts_by_participant(self) -> dict[str, set[EpisodeId]]:
        """By participant URL (every one that replied), the episodes it named as restarts."""
        return {
            url: {parse_episode_key(key) for key in reply.report.restarts}
            for url, reply in self.replies.items()
        }

    def continued(self, episode_ids: list[EpisodeId]) -> list[EpisodeId]:
        """The commit scope: `episode_ids` without the restarts."""
        restarts = self.restarts()
        return [e for e in episode_ids if e.key not in restarts]


class Controller:
    """Checkpoint, restore, resume, retire and forget across several participants."""

    def __init__(self, participants: list[Participant], timeout: float = 300.0) -> None:
        self.participants = participants
        self.timeout = timeout
        # op -> participant URL -> seconds its last such call took (for benches and logs)
        self.timings: dict[str, dict[str, float]] = {}

    def _deadline(self) -> float:
        return time.time() + self.timeout

    async def learn_kinds(self) -> None:
        await asyncio.gather(*(p.learn_kind() for p in self.participants))

    def _of_kind(self, kinds: tuple[str, ...]) -> list[Participant]:
        return [p for p in self.participants if p.kind in kinds]

    def _stages(self) -> list[list[Participant]]:
        stages = [self._of_kind((kind,)) for kind in KIND_ORDER]
        stages.append([p for p in self.participants if p.kind not in KIND_ORDER])
        return [stage for stage in stages if stage]

    async def _fan_out(
        self, members: list[Participant], op: str, answer: type[A], deadline_ts: float, **body: Any
    ) -> dict[str, A]:
        """The same call to every member at once; ControlFailed names every failure."""
        results = await asyncio.gather(
            *(self._timed(m, op, answer, deadline_ts, body) for m in members),
            return_exceptions=True,
        )
        failures: dict[str, tuple[int, str, str]] = {}
        replies: dict[str, A] = {}
        for member, result in zip(members, results, strict=True):
            if isinstance(result, ControlFailed):
                failures.update(result.failures)
            elif isinstance(result, BaseException):
                raise result
            else:
                replies[member.url] = result
        if failures:
            raise ControlFailed(op, failures)
        return replies

    async def _timed(
        self,
        member: Participant,
        op: str,
        answer: type[A],
        deadline_ts: float,
        body: dict[str, Any],
    ) -> A:
        started = time.perf_counter()
        try:
            return await member.call(op, answer, deadline_ts, **body)
        finally:
            self.timings.setdefault(op, {})[member.url] = time.perf_counter() - started

    async def prepare(self, checkpoint_id: str, deadline_ts: float | None = None) -> PrepareResult:
        """Prepare stage by stage; stop at the first stage that is not prepared."""
        deadline_ts = deadline_ts or self._deadline()
        replies: dict[str, PrepareAnswer] = {}
        for stage in self._stages():
            got = await self._fan_out(
                stage, "prepare", PrepareAnswer, deadline_ts, checkpoint_id=checkpoint_id
            )
            replies.update(got)
            if any(reply.phase != "prepared" for reply in got.values()):
                return PrepareResult(False, replies)
        return PrepareResult(True, replies)

    async def commit(
        self,
        checkpoint_id: str,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId] | None = None,
        stop: bool = False,
    ) -> dict[str, CommitAnswer]:
        """Commit every participant at once into one checkpoint directory."""
        body: dict[str, Any] = {"checkpoint_id": checkpoint_id, "checkpoint_dir": checkpoint_dir}
        if episode_ids is not None:
            body["episode_ids"] = [e.as_json() for e in episode_ids]
        if stop:
            body["stop"] = True
        return await self._fan_out(
            self.participants, "commit", CommitAnswer, self._deadline(), **body
        )

    async def checkpoint(
        self,
        checkpoint_id: str,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId] | None = None,
        *,
        stop: bool = False,
        stragglers: str = "fail",
        keep_open: bool = False,
    ) -> CheckpointResult:
        """prepare, commit, then resume (resume after a failure too, and raise).

        `stragglers="retire"`: a prepare that is not ready resumes, retires the blocking
        episodes (they start over), and prepares once more. `keep_open`: leave the
        checkpoint open after a successful commit (the caller resumes). The result names,
        by participant, the restarts the prepare reported: they are not in the checkpoint
        (`CheckpointResult.complete` is False)."""
        retired: list[EpisodeId] = []
        result = await self.prepare(checkpoint_id)
        if not result.prepared and stragglers == "retire" and result.blocking_episodes():
            retired = result.blocking_episodes()
            await self.resume(checkpoint_id)
            await self.retire(checkpoint_id, retired)
            checkpoint_id = f"{checkpoint_id}.r"
            result = await self.prepare(checkpoint_id)
        committed = False
        try:
            if not result.prepared:
                blockers = {url: b[:5] for url, b in result.blockers().items()}
                raise ControlFailed("prepare", {"not ready": (409, "not_ready", str(blockers))})
            scope = None if episode_ids is None else result.continued(episode_ids)
            replies = await self.commit(checkpoint_id, checkpoint_dir, scope, stop)
            committed = True
        finally:
            if not (committed and keep_open):
                await self.resume(checkpoint_id)
        return CheckpointResult.of(
            checkpoint_id, replies, result.restarts_by_participant(), retired
        )

    async def restore(
        self, checkpoint_id: str, checkpoint_dir: str, episode_ids: list[EpisodeId]
    ) -> dict[str, RestoreAnswer]:
        """Restore every participant at once, or none: on any failure the attempts it would
        continue are retired everywhere, everything is resumed, and the error raised."""
        body = {
            "checkpoint_id": checkpoint_id,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": [e.as_json() for e in episode_ids],
        }
        try:
            return await self._fan_out(
                self.participants, "restore", RestoreAnswer, self._deadline(), **body
            )
        except ControlFailed:
            cleanup = max(self._deadline(), time.time() + RESTORE_CLEANUP_SECONDS)
            try:
                if episode_ids:
                    await self.retire(
                        checkpoint_id, [e.next_attempt() for e in episode_ids], deadline_ts=cleanup
                    )
            finally:
                await self.resume(checkpoint_id, deadline_ts=cleanup, quiet=True)
            raise

    async def resume(
        self, checkpoint_id: str, deadline_ts: float | None = None, quiet: bool = False
    ) -> None:
        """Resume every participant, stages in reverse, past failures (an unreachable one
        resumes by itself when its lease expires)."""
        deadline_ts = deadline_ts or self._deadline()
        failures: dict[str, tuple[int, str, str]] = {}
        for stage in reversed(self._stages()):
            try:
                await self._fan_out(
                    stage, "resume", ResumeAnswer, deadline_ts, checkpoint_id=checkpoint_id
                )
            except ControlFailed as exc:
                failures.update(exc.failures)
        if failures and not quiet:
            raise ControlFailed("resume", failures)

    async def retire(
        self,
        checkpoint_id: str,
        episode_ids: list[EpisodeId],
        deadline_ts: float | None = None,
    ) -> None:
        """Retire attempts on callers before callees."""
        if not episode_ids:
            return
        ids = [e.as_json() for e in episode_ids]
        await self._in_retire_order(
            "retire",
            RetireAnswer,
            deadline_ts or self._deadline(),
            checkpoint_id=checkpoint_id,
            episode_ids=ids,
        )

    async def forget(self, checkpoint_id: str, rollout_ids: list[str]) -> None:
        """Stop refusing the retired attempts of these rollouts, callers before callees."""
        if rollout_ids:
            await self._in_retire_order(
                "forget",
                ForgetAnswer,
                self._deadline(),
                checkpoint_id=checkpoint_id,
                rollout_ids=sorted(set(rollout_ids)),
            )

    async def _in_retire_order(
        self, op: str, answer: type[Message], deadline_ts: float, **body: Any
    ) -> None:
        ranked = {kind for kinds in RETIRE_ORDER for kind in kinds}
        groups = [self._of_kind(kinds) for kinds in RETIRE_ORDER]
        groups.append([p for p in self.participants if p.kind not in ranked])
        for group in groups:
            if group:
                await self._fan_out(group, op, answer, deadline_ts, **body)

    async def status(self) -> list[ServerStatus]:
        return list(await asyncio.gather(*(p.status() for p in self.participants)))
