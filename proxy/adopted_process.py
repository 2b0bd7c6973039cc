"""A process this one watches and signals but did not start: an adopted worker (a dead
or passed-on gym-proxy's, `proxy.fleet.supervision.adoption`), or the Ray process holding a cluster
a dead gym-proxy left waiting (`proxy.ray_cluster.cluster`).

On its own, below both: the fleet and the Ray cluster each use it, and neither imports
the other for it.
"""

from __future__ import annotations

import asyncio
import os
import signal

from gym_proxy.coordinator.contract.exit_codes import EXIT_UNKNOWN

__all__ = ["AdoptedProcess"]


class AdoptedProcess:
    """A `proxy.fleet.supervision.worker_records.WorkerHandle` for a process this one did not start:
    not its child, so it is watched and signalled through a pidfd, which names the
    process itself, never a later one that reuses its pid. Its exit status belongs to its
    parent: `wait` gives EXIT_UNKNOWN."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)
        self.returncode: int | None = None
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(self._fd, self._on_exit)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        self.returncode = EXIT_UNKNOWN
        if not self._exited.done():
            self._exited.set_result(EXIT_UNKNOWN)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int, /) -> None:
        if self._fd < 0:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._fd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
