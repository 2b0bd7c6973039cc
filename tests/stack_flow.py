"""The moves of the end-to-end tests on the reference stack: run rollouts, wait until they
are held at the model, checkpoint, crash, restore, continue, and check what is left.

Everything here drives real processes (`gym_proxy.worker.apps.stack.Stack`) through their public
interfaces: `/run`, the control plane (`gym_proxy.coordinator.clients.controller`), and `GET /held`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from gym_proxy.coordinator.clients.controller import Controller, Participant
from gym_proxy.coordinator.clients.rollouts import Rollout, RolloutDriver, exported_rollouts
from gym_proxy.coordinator.clients.rollouts_cli import weather_rollouts
from gym_proxy.coordinator.contract.episodes import EpisodeId
from gym_proxy.worker.apps.stack import Stack
from tests.support import wait_until

__all__ = ["StackRun", "HOLD_SECOND_CALL"]

OWNER = "x-ng-session-owner"


def HOLD_SECOND_CALL(hold_file: str) -> dict[str, str]:  # noqa: N802
    """Stack environment: the model holds every rollout's second call while the file
    exists (rollouts park mid-turn, after their tool call)."""
    return {"GYM_FAKE_MODEL_HOLD_FILE": hold_file, "GYM_FAKE_MODEL_HOLD_CALLS": "2"}


class StackRun:
    """One test's stack, driver and controller."""

    def __init__(self, stack: Stack, http: aiohttp.ClientSession, entry: str = "env") -> None:
        self.stack = stack
        self.http = http
        self.entry = entry  # "env" (native single_turn) or "agent" (legacy /run)
        self.driver = RolloutDriver(stack.urls[entry], http, concurrency=64)
        self.exported: dict[str, EpisodeId] = {}

    async def controller(self) -> Controller:
        participants = [
            Participant(url, self.stack.control_token, self.http)
            for url in self.stack.urls.values()
        ]
        controller = Controller(participants, timeout=60)
        await controller.learn_kinds()
        return controller

    def rollouts(self, count: int, prefix: str = "r", prompt_bytes: int = 0) -> list[Rollout]:
        return weather_rollouts(count, prefix, prompt_bytes)

    async def held(self, server: str) -> int:
        """Calls waiting at a hold switch, summed over the server's workers."""
        status = await self.status(server)
        total = 0
        for worker in status["workers"]:
            url = f"{self.stack.urls[server]}/held"
            async with self.http.get(url, headers={OWNER: worker["owner"]}) as resp:
                total += (await resp.json())["held"]
        return total

    async def status(self, server: str) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.stack.control_token}"}
        url = f"{self.stack.urls[server]}/ng-control/v1/checkpoint/status"
        async with self.http.get(url, headers=headers) as resp:
            return await resp.json()

    async def wait_held(
        self, server: str, count: int, within: float = 60, running: asyncio.Future | None = None
    ) -> None:
        """Until `count` calls wait at `server`'s hold switch; `running` (a driver run)
        ending first fails at once, with how its rollouts ended."""

        async def enough() -> bool:
            if running is not None and running.done():
                ended = [(r.rollout_id, r.status, r.error) for r in running.result()]
                raise AssertionError(f"the rollouts ended before {count} were held: {ended}")
            return await self.held(server) >= count

        try:
            await wait_until(enough, within, f"{count} calls held at {server}")
        except AssertionError as exc:
            logs = "".join(
                f"\n--- {name}.log ---\n{self.stack.log(name)[-1500:]}" for name in self.stack.urls
            )
            raise AssertionError(f"{exc}{logs}") from None

    async def checkpoint(self, checkpoint_id: str, directory: str) -> dict[str, EpisodeId]:
        """prepare and commit (no resume: the caller crashes or resumes)."""
        controller = await self.controller()
        prepared = await controller.prepare(checkpoint_id)
        assert prepared.prepared, prepared.blockers()
        replies = await controller.commit(checkpoint_id, directory)
        self.exported = exported_rollouts(replies)
        return self.exported

    async def restore(
        self, checkpoint_id: str, directory: str, workers: Any = None, resume: bool = True
    ) -> None:
        """Start the stack again (new worker counts if given) and restore into it."""
        self.stack.start(workers)
        controller = await self.controller()
        await controller.restore(
            checkpoint_id, directory, sorted(self.exported.values(), key=lambda e: e.key)
        )
        if resume:
            await controller.resume(checkpoint_id)

    async def crash(self, running: asyncio.Future[Any] | None = None) -> None:
        """Kill every process group; the dispatches in flight fail."""
        self.stack.kill()
        if running is not None:
            await asyncio.wait_for(running, 60)

    async def continue_rollouts(self, rollouts: list[Rollout]) -> list[Rollout]:
        RolloutDriver.continue_after_restore(rollouts, set(self.exported))
        return await self.driver.run(rollouts)

    async def nothing_left_behind(self, checkpoint_id: str = "final") -> None:
        """Every participant idle: no restored records pending, and a prepare finds no
        session and no request on any worker (then resumes)."""
        controller = await self.controller()
        for server in self.stack.urls:
            status = await self.status(server)
            assert status["restored_pending"] == [], (server, status["restored_pending"])
        prepared = await controller.prepare(checkpoint_id)
        try:
            assert prepared.prepared, prepared.blockers()
            for url, reply in prepared.replies.items():
                counts = reply.report.counts
                assert counts.get("sessions", 0) == 0, (url, counts)
                assert counts.get("in_flight", 0) == 0, (url, counts)
        finally:
            await controller.resume(checkpoint_id)


def all_scored(rollouts: list[Rollout], check: Callable[[Rollout], bool] | None = None) -> None:
    """Every rollout finished with reward 1.0 after exactly two model calls and one tool
    call (no step ran twice past a boundary), and each passes `check`."""
    for rollout in rollouts:
        assert rollout.finished, (rollout.rollout_id, rollout.history)
        reply = rollout.reply
        assert reply["reward"] == 1.0, (rollout.rollout_id, reply)
        assert (reply["model_calls"], reply["tool_calls"], reply["weather_tool_calls"]) == (
            2,
            1,
            1,
        ), (rollout.rollout_id, reply)
        if check is not None:
            assert check(rollout), (rollout.rollout_id, rollout.attempt, rollout.history)
