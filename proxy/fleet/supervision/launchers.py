"""What starts the workers, as the supervisor sees it: a `WorkerLauncher`.

A launcher is chosen and made at start-up (`proxy.launch`), opened once the server has
booted what the workers need (its Ray cluster, started or checked) with the `Launch`
they start into, and closed after the workers stopped; the server's exit stack does
all three (`proxy.server`). The supervisor only spawns through it.

A worker's environment is the proxy's own plus what is declared for the workers in the
`Launch` (a NeMo Gym server's config, the cluster's address), never something the proxy
wrote into its own `os.environ` for them to inherit.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gym_proxy.proxy.fleet.supervision.worker_records import WorkerHandle

__all__ = [
    "AcceptChannel",
    "Launch",
    "WorkerLauncher",
    "FindsLeftWorkers",
    "SubprocessLauncher",
    "WORKER_COMMAND",
    "environment_of",
]

# Where a coordinator channel dialed in from a worker goes (one that does not connect to
# the local socket: a worker placed on a node).
AcceptChannel = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass(frozen=True)
class Launch:
    """What every worker starts into: the environment declared for the workers (added to
    the proxy's own), the Ray cluster they join (None: none), and where a channel a
    worker's launcher dials in goes."""

    environment: Mapping[str, str] = field(default_factory=dict)
    ray_address: str | None = None
    accept_channel: AcceptChannel | None = None


class WorkerLauncher(Protocol):
    """What starts workers: a subprocess each (`SubprocessLauncher`), the zygote
    (--preload: `proxy.fleet.supervision.zygote_client.Zygote`), the nodes of a Ray cluster
    (`proxy.ray_cluster.remote_workers.RayLauncher`), or a test's in-process launcher
    (`tests/in_process.py`). `spawn` before `open` is refused (OSError)."""

    async def open(self, launch: Launch) -> None: ...

    async def spawn(self, argv: list[str]) -> WorkerHandle: ...

    async def close(self) -> None: ...


@runtime_checkable
class FindsLeftWorkers(Protocol):
    """A launcher whose workers may outlive a gym-proxy that dies where it cannot see them
    (Ray's, on the cluster's nodes): `find` starts following those a predecessor with
    this runtime directory left, `dial_left` dials their channels, over which each
    rejoins; `left` is the handle of the one listening at `address`. `let_go`: this
    gym-proxy passes its workers on to a `--take-over` successor, which finds them so."""

    async def find(self) -> int: ...

    def dial_left(self) -> None: ...

    def let_go(self) -> None: ...

    def left(self, address: str) -> WorkerHandle | None: ...


# `python -P`: the current directory never shadows gym-proxy's packages.
WORKER_COMMAND = (sys.executable, "-P", "-m", "gym_proxy.worker")


@dataclass(eq=False)
class SubprocessLauncher:
    """A fresh interpreter per worker, started with its arguments (tests of the
    supervisor start stand-in workers with another `command`)."""

    command: tuple[str, ...] = WORKER_COMMAND
    _environment: dict[str, str] | None = None  # the workers', once open

    async def open(self, launch: Launch) -> None:
        self._environment = environment_of(launch)

    async def spawn(self, argv: list[str]) -> WorkerHandle:
        if self._environment is None:
            raise OSError("the worker launcher is not open")
        return await asyncio.create_subprocess_exec(
            *self.command, *argv, stdin=asyncio.subprocess.DEVNULL, env=self._environment
        )

    async def close(self) -> None:
        return None


def environment_of(launch: Launch) -> dict[str, str]:
    """A local worker's whole environment under `launch`."""
    return {**os.environ, **launch.environment}
