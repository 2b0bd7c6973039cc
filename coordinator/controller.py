"""A small checkpoint controller: drives one or more participants over their control plane.

Across servers the order matters (DESIGN.md): prepare environment, then model, then
agent, then resources (callers park before their callees close), resume in reverse,
commit and restore go to all at once, retire goes to callers before callees. A prepare
that does not get every participant ready by the deadline resumes the ones it closed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["KIND_ORDER", "ControlFailed", "Participant", "Controller", "in_call_order"]

KIND_ORDER = ("environment", "model", "agent", "resources")


class ControlFailed(Exception):
    """A participant refused a control call (or could not be reached)."""

    def __init__(self, url: str, status: int, code: str, detail: str) -> None:
        super().__init__(f"{url}: {status} {code}: {detail}")
        self.url = url
        self.status = status
        self.code = code


@dataclass
class Participant:
    """One server's control plane (a gym-proxy, or any NeMo Gym participant)."""

    url: str
    token: str
    http: aiohttp.ClientSession
    kind: str = "resources"

    async def call(self, op: str, **body: Any) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.token}"}
        base = f"{self.url.rstrip('/')}/ng-control/v1/checkpoint"
        try:
            if op == "status":
                request = self.http.get(f"{base}/status", headers=headers)
            else:
                request = self.http.post(f"{base}/{op}", json=body, headers=headers)
            async with request as resp:
                reply = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, ValueError) as exc:
            raise ControlFailed(self.url, 0, "unreachable", str(exc)) from exc
        if status != 200:
            error = reply.get("error", {}) if isinstance(reply, dict) else {}
            raise ControlFailed(self.url, status, error.get("code", "?"), error.get("detail", ""))
        return reply

    async def learn_kind(self) -> str:
        self.kind = (await self.call("status"))["kind"] or "resources"
        return self.kind


def in_call_order(participants: list[Participant]) -> list[Participant]:
    """Callers before callees: environment, model, agent, resources (others last)."""
    rank = {kind: i for i, kind in enumerate(KIND_ORDER)}
    return sorted(participants, key=lambda p: rank.get(p.kind, len(KIND_ORDER)))


class Controller:
    """Checkpoint, restore, resume and retire across several participants."""

    def __init__(self, participants: list[Participant], timeout: float = 300.0) -> None:
        self.participants = participants
        self.timeout = timeout

    def _deadline(self) -> float:
        return time.time() + self.timeout

    async def learn_kinds(self) -> None:
        await asyncio.gather(*(p.learn_kind() for p in self.participants))

    async def prepare(self, checkpoint_id: str) -> None:
        """Prepare each participant in call order; on failure resume those closed."""
        deadline = self._deadline()
        closed: list[Participant] = []
        try:
            for participant in in_call_order(self.participants):
                closed.append(participant)
                reply = await participant.call(
                    "prepare", checkpoint_id=checkpoint_id, deadline_ts=deadline
                )
                if reply["phase"] != "prepared":
                    blockers = ", ".join(reply["report"]["blockers"][:5])
                    raise ControlFailed(participant.url, 409, "not_ready", blockers)
        except ControlFailed:
            await self._resume(closed, checkpoint_id)
            raise

    async def commit(
        self, checkpoint_id: str, checkpoint_dir: str, episode_ids: list[dict] | None = None
    ) -> list[dict[str, Any]]:
        """Commit every participant at once into one checkpoint directory."""
        body: dict[str, Any] = {"checkpoint_dir": checkpoint_dir}
        if episode_ids is not None:
            body["episode_ids"] = episode_ids
        return await self._all("commit", checkpoint_id, **body)

    async def checkpoint(
        self, checkpoint_id: str, checkpoint_dir: str, episode_ids: list[dict] | None = None
    ) -> list[dict[str, Any]]:
        """prepare, commit, then resume (or resume after a failure and raise)."""
        await self.prepare(checkpoint_id)
        try:
            return await self.commit(checkpoint_id, checkpoint_dir, episode_ids)
        finally:
            await self.resume(checkpoint_id)

    async def restore(
        self, checkpoint_id: str, checkpoint_dir: str, episode_ids: list[dict]
    ) -> list[dict[str, Any]]:
        """Restore every participant at once (they stay closed until resume)."""
        return await self._all(
            "restore", checkpoint_id, checkpoint_dir=checkpoint_dir, episode_ids=episode_ids
        )

    async def resume(self, checkpoint_id: str) -> None:
        await self._resume(self.participants, checkpoint_id)

    async def retire(self, checkpoint_id: str, episode_ids: list[dict]) -> None:
        """Retire attempts on callers before callees."""
        for participant in in_call_order(self.participants):
            await participant.call(
                "retire", checkpoint_id=checkpoint_id, deadline_ts=self._deadline(),
                episode_ids=episode_ids,
            )  # fmt: skip

    async def status(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(p.call("status") for p in self.participants)))

    async def _resume(self, participants: list[Participant], checkpoint_id: str) -> None:
        failures = []
        for participant in reversed(in_call_order(participants)):
            try:
                await participant.call(
                    "resume", checkpoint_id=checkpoint_id, deadline_ts=self._deadline()
                )
            except ControlFailed as exc:  # resume the rest regardless
                failures.append(exc)
        if failures:
            raise failures[0]

    async def _all(self, op: str, checkpoint_id: str, **body: Any) -> list[dict[str, Any]]:
        deadline = self._deadline()
        return list(
            await asyncio.gather(*(
                p.call(op, checkpoint_id=checkpoint_id, deadline_ts=deadline, **body)
                for p in self.participants
            ))
        )  # fmt: skip
