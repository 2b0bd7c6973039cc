"""One worker process on a node of the Ray cluster, started and watched by a Ray actor.

`WorkerHost` binds the worker's TCP port on the node's own address (never all of its
addresses: nothing listens beyond the cluster's network), starts `python -m
gym_proxy.worker` with that socket inherited (`--socket=fd:N`, `--coordinator=accept`:
the proxy dials the worker's channel in through its gate, `worker.link_gate`), and
reports the worker's exit. The process is the same worker a local slot runs; only where
it listens differs. It stops by itself when its coordinator channel ends, as a local
worker does, so a proxy that dies (or an actor killed with its node) leaves no worker
behind for long.

`RayWorkerHost` is the actor (`proxy.ray_cluster.placement` creates one per worker): the
host plus what only Ray knows, the node's address and ID. Its methods run on a thread
pool (`max_concurrency`), so that `wait` blocks while `signal` is served.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

__all__ = ["WorkerHost", "RayWorkerHost", "WORKER_COMMAND"]

WORKER_COMMAND = (sys.executable, "-P", "-m", "gym_proxy.worker")
BACKLOG = 4096  # as a local worker's socket (`worker.identity.WORKER_BACKLOG`)


class WorkerHost:
    """Start one worker on `host`, wait for it, signal it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def start(
        self, argv: list[str], env: dict[str, str], host: str, cwd: str = ""
    ) -> dict[str, Any]:
        """Bind a port on `host`, start the worker with it (in `cwd` when the node has
        that directory, as a local worker runs in the proxy's); its pid and the port."""
        with socket.create_server((host, 0), backlog=BACKLOG) as sock:
            fd = sock.fileno()
            self.process = subprocess.Popen(
                [*WORKER_COMMAND, *argv, f"--socket=fd:{fd}", "--coordinator=accept"],
                pass_fds=(fd,),
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                cwd=cwd if cwd and os.path.isdir(cwd) else None,
            )
            port = sock.getsockname()[1]
        return {"pid": self.process.pid, "host": host, "port": port}

    def wait(self) -> int:
        """The worker's exit status, once it exits (negative: the signal that ended it)."""
        assert self.process is not None
        return self.process.wait()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(sig)


class RayWorkerHost(WorkerHost):
    """The actor: a `WorkerHost` on the node Ray placed it on."""

    def start_here(self, argv: list[str], env: dict[str, str], cwd: str) -> dict[str, Any]:
        import ray  # only on a node, in Ray's worker process

        context = ray.get_runtime_context()
        started = self.start(argv, env, ray.util.get_node_ip_address(), cwd)
        started["node_id"] = context.get_node_id()
        started["hostname"] = socket.gethostname()
        return started
