"""When a worker is recycled: past `--max-requests` (plus a jitter of its own, so that
workers started together are not recycled together) or `--max-worker-memory`.

The policy only asks (`Operations.recycle`, a rolling restart of the slot); the ask is
repeated every interval until it happens, since a checkpoint or another operation may
defer it. Memory is sampled from /proc, so this is a timer, not an event.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gym_proxy.proxy.config import Config
from gym_proxy.proxy.fleet.supervision.worker_records import Slot

__all__ = ["RecyclePolicy", "SETTLE"]

log = logging.getLogger("gym_proxy.operations")

SETTLE = 10.0  # seconds a fresh worker's memory gets to settle before it counts
CHECK_INTERVAL = 1.0


@dataclass(eq=False)
class RecyclePolicy:
    config: Config
    slots: Callable[[], Iterable[Slot]]
    recycle: Callable[[int, str], None]  # (slot, reason): the ask
    _limits: dict[str, int] = field(default_factory=dict)  # owner -> its --max-requests
    _warned_ceiling: bool = False

    async def watch(self) -> None:
        """Check every CHECK_INTERVAL seconds, for as long as the server serves."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL)
            self.check()

    def check(self) -> None:
        """Ask for a recycle of each slot's worker past its request limit or the memory
        ceiling."""
        ceiling = self.config.max_worker_memory * 1024 * 1024
        live = set()
        for slot in self.slots():
            worker = slot.worker
            if worker is None or worker.state != "live" or worker.route is None:
                continue
            live.add(worker.owner)
            limit = self._limit(worker.owner)
            if limit and worker.route.served >= limit:
                self.recycle(worker.slot, f"served {worker.route.served} requests")
            elif ceiling and (rss := worker.memory()) > ceiling:
                if time.monotonic() - worker.started_at >= SETTLE:
                    self.recycle(worker.slot, f"resident memory {rss / 2**20:.0f} MiB")
                elif not self._warned_ceiling:
                    # Its replacement would be over it too: a recycle a few seconds apart,
                    # for ever. It is still done (the ceiling is the operator's), but said.
                    self._warned_ceiling = True
                    log.warning(
                        "--max-worker-memory %g MiB is below a fresh worker's resident "
                        "memory (%.0f MiB): every worker will be recycled about every %g s",
                        self.config.max_worker_memory,
                        rss / 2**20,
                        SETTLE,
                    )
        for gone in self._limits.keys() - live:
            del self._limits[gone]

    def _limit(self, owner: str) -> int:
        limit = self._limits.get(owner)
        if limit is None:
            limit = self.config.max_requests
            if limit:
                limit += random.randint(0, self.config.max_requests_jitter)
            self._limits[owner] = limit
        return limit
