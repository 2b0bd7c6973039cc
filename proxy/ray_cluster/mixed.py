"""`--local-workers K` with `--worker-placement ray`: one server whose first K slots'
workers are processes of gym-proxy's machine and the others placed on the cluster.

Which launcher starts a worker is decided by its slot, so that a slot keeps its kind
through every restart, replacement and rolling restart: slots 0..K-1 local, the rest
placed. A resize grows and shrinks at the end, so the placed workers come and go with
the count (and Ray's autoscaler with them) while the local ones stay. Everything the
fleet does across workers (moves, rebalance, a restore's placement, a checkpoint) goes
over each worker's channel, so it crosses the mix as it crosses nodes. The placed
workers a dead predecessor left are found through the Ray launcher (`FindsLeftWorkers`);
the local ones rejoin on the coordinator socket, as in an all-local server.
"""

from __future__ import annotations

from dataclasses import dataclass

from gym_proxy.proxy.fleet.supervision.launchers import Launch, WorkerLauncher
from gym_proxy.proxy.fleet.supervision.worker_records import WorkerHandle
from gym_proxy.proxy.ray_cluster.remote_workers import RayLauncher

__all__ = ["MixedLauncher", "slot_of"]


def slot_of(argv: list[str]) -> int:
    """The slot a worker's arguments (`worker.options.worker_argv`) name."""
    for arg in argv:
        if arg.startswith("--slot="):
            return int(arg.removeprefix("--slot="))
    raise ValueError("a worker's arguments name no --slot")


@dataclass(eq=False)
class MixedLauncher:
    """Local workers for the first `local_slots` slots, placed ones for the others."""

    local: WorkerLauncher
    placed: RayLauncher
    local_slots: int

    async def open(self, launch: Launch) -> None:
        await self.local.open(launch)
        await self.placed.open(launch)

    async def spawn(self, argv: list[str]) -> WorkerHandle:
        if slot_of(argv) < self.local_slots:
            return await self.local.spawn(argv)
        return await self.placed.spawn(argv)

    async def close(self) -> None:
        try:
            await self.placed.close()
        finally:
            await self.local.close()

    # FindsLeftWorkers: only placed workers need finding.
    async def find(self) -> int:
        return await self.placed.find()

    def dial_left(self) -> None:
        self.placed.dial_left()

    def let_go(self) -> None:
        self.placed.let_go()

    def left(self, address: str) -> WorkerHandle | None:
        return self.placed.left(address)
