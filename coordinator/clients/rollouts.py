"""A rollout driver in the shape of NeMo Gym's rollout collection.

It runs rollouts against an environment server's `/run` with bounded concurrency,
stamping each with `_ng_rollout_id` and `_ng_attempt_index` at dispatch, and records
every reply. Checkpoints are the controller's (`gym_proxy.coordinator.clients.controller`); after a
restore, `continue_after_restore` moves every unfinished rollout to attempt N+1: an
exported one then continues from its record (its `/run` claims it), any other starts
over.

    driver = RolloutDriver(env_url, http, concurrency=64)
    rollouts = [Rollout(f"r{i}", {"city": "Oslo"}) for i in range(100)]
    await driver.run(rollouts)
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp

from gym_proxy.coordinator.contract.answers import CommitAnswer
from gym_proxy.coordinator.contract.episodes import EpisodeId, parse_episode_key

__all__ = ["Rollout", "RolloutDriver", "Progress", "exported_rollouts"]


@dataclass
class Rollout:
    """One rollout: its task, its current attempt, and how its last dispatch ended."""

    rollout_id: str
    task: dict[str, Any]
    attempt: int = 0
    status: int | None = None
    reply: Any = None
    error: str | None = None
    history: list[tuple[int, int | None, str | None]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """The last dispatch answered 200 and its whole reply arrived."""
        return self.status == 200 and self.error is None

    @property
    def episode_id(self) -> EpisodeId:
        return EpisodeId(self.rollout_id, self.attempt)

    def body(self) -> dict[str, Any]:
        return {**self.task, "_ng_rollout_id": self.rollout_id, "_ng_attempt_index": self.attempt}


class Progress:
    """A one-line progress bar on a terminal (nothing elsewhere)."""

    def __init__(self, total: int, out: TextIO = sys.stderr, label: str = "rollouts") -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.out = out
        self.label = label
        self.live = out.isatty()
        self.started = time.monotonic()
        self._shown = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.monotonic()
        if self.live and (now - self._shown > 0.1 or self.done == self.total):
            self._shown = now
            width = 30
            filled = width * self.done // max(1, self.total)
            rate = self.done / max(1e-9, now - self.started)
            self.out.write(
                f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                f"{self.done}/{self.total} {rate:,.0f}/s failed {self.failed}"
            )
            if self.done == self.total:
                self.out.write("\n")
            self.out.flush()


class RolloutDriver:
    """Dispatches rollouts to `env_url`/run, at most `concurrency` at a time."""

    def __init__(
        self,
        env_url: str,
        http: aiohttp.ClientSession,
        concurrency: int = 64,
        progress: bool = False,
    ) -> None:
        self.run_url = f"{env_url.rstrip('/')}/run"
        self.http = http
        self.concurrency = concurrency
        self.progress = progress

    async def run(self, rollouts: Iterable[Rollout]) -> list[Rollout]:
        """Dispatch every unfinished rollout once; return them (replies recorded)."""
        pending = [r for r in rollouts if not r.finished]
        gate = asyncio.Semaphore(self.concurrency)
        bar = Progress(len(pending)) if self.progress else None

        async def one(rollout: Rollout) -> None:
            async with gate:
                await self.dispatch(rollout)
            if bar is not None:
                bar.update(rollout.finished)

        await asyncio.gather(*(one(r) for r in pending))
        return pending

    async def dispatch(self, rollout: Rollout) -> None:
        """One `/run` of the rollout's current attempt; the outcome is recorded on it."""
        rollout.status = rollout.reply = rollout.error = None
        try:
            async with self.http.post(self.run_url, json=rollout.body()) as resp:
                try:
                    rollout.reply = await resp.json(content_type=None)
                finally:
                    # Only once the body is in (or lost): a rollout whose reply is still
                    # on its way, or was cut off, has not finished.
                    rollout.status = resp.status
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            rollout.error = f"{type(exc).__name__}: {exc}"
        rollout.history.append((rollout.attempt, rollout.status, rollout.error))

    @staticmethod
    def continue_after_restore(rollouts: Iterable[Rollout], exported: set[str]) -> list[str]:
        """Move every unfinished rollout to its next attempt (N+1): the exported ones
        (rollout IDs in `exported`) continue from their records, the others start over.
        Returns the rollout IDs that start over."""
        fresh = []
        for rollout in rollouts:
            if rollout.finished:
                continue
            rollout.attempt += 1
            if rollout.rollout_id not in exported:
                fresh.append(rollout.rollout_id)
        return fresh


def exported_rollouts(commit_replies: dict[str, CommitAnswer]) -> dict[str, EpisodeId]:
    """Rollout ID -> exported attempt, from every participant's commit answer."""
    exported: dict[str, EpisodeId] = {}
    for reply in commit_replies.values():
        for key in reply.episode_ids:
            episode = parse_episode_key(key)
            exported[episode.rollout_id] = episode
    return exported
