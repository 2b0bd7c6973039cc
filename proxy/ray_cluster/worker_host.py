"""One worker process on a node of the Ray cluster, started and watched by a Ray actor.

`WorkerHost` binds the worker's port: on gym-proxy's own node, when it runs as
gym-proxy's user, a Unix socket in gym-proxy's runtime directory (0700: nobody else can
reach it, and the proxy pays no loopback TCP per request); elsewhere a TCP port on the
node's own address (never all of its addresses: nothing listens beyond the cluster's
network). It starts `python -m gym_proxy.worker` with that socket inherited
(`--socket=fd:N`, `--coordinator=accept`: the proxy dials the worker's channel in
through its gate, `worker.link_gate`), and reports the worker's exit. The process is the
same worker a local slot runs; only where it listens differs. It stops by itself when
its coordinator channel ends, as a local worker does, so a proxy that dies (or an actor
killed with its node) leaves no worker behind for long.

`RayWorkerHost` is the actor (`proxy.ray_cluster.placement` creates one per worker, detached
so that it outlives a driver that dies): the host plus what only Ray knows, the node's
address and ID. Its methods run on a thread pool (`max_concurrency`), so that `wait`
blocks while `signal` is served. Once its worker exited, it ends itself if no driver
has ended it within ORPHANED_AFTER seconds; one never asked to start a worker within
UNASKED_AFTER seconds of its creation ends itself too: its driver died while the actor
waited for room (a node the autoscaler was adding), and the `start_here` call that
driver queued died with it (a Ray task is its caller's), so nobody else would end it.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from gym_proxy.coordinator.contract.exit_codes import EXIT_UNKNOWN
from gym_proxy.proxy.ray_cluster.node_zygote import NodeZygote, name_of
from gym_proxy.proxy.ray_cluster.worker_port import bind_port, private_directory

__all__ = ["WorkerHost", "RayWorkerHost", "WORKER_COMMAND", "private_directory"]

WORKER_COMMAND = (sys.executable, "-P", "-m", "gym_proxy.worker")
ORPHANED_AFTER = 10.0  # seconds an exited worker's actor waits for a driver to end it
# Seconds a new actor waits for its driver's `start_here`; the call is queued when the
# actor is made, so it comes at once unless its driver is gone.
UNASKED_AFTER = 30.0


class WorkerHost:
    """Start one worker, on a Unix socket in `unix_dir` or a TCP port of `host`, wait
    for it, signal it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.path = ""

    def start(
        self, argv: list[str], env: dict[str, str], host: str, cwd: str = "", unix_dir: str = ""
    ) -> dict[str, Any]:
        """Bind the port (`bind_port`), start the worker with it (in `cwd` when the node
        has that directory, as a local worker runs in the proxy's); its pid and the port."""
        sock, self.path = bind_port(host, unix_dir)
        with sock:
            fd = sock.fileno()
            self.process = subprocess.Popen(
                [*WORKER_COMMAND, *argv, f"--socket=fd:{fd}", "--coordinator=accept"],
                pass_fds=(fd,),
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                cwd=cwd if cwd and os.path.isdir(cwd) else None,
            )
            port = 0 if self.path else sock.getsockname()[1]
        return {"pid": self.process.pid, "host": host, "port": port, "path": self.path}

    def wait(self) -> int:
        """The worker's exit status, once it exits (negative: the signal that ended it);
        its Unix socket's file goes with it."""
        assert self.process is not None
        code = self.process.wait()
        self._unlink()
        return code

    def _unlink(self) -> None:
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(sig)


class RayWorkerHost(WorkerHost):
    """The actor: a `WorkerHost` on the node Ray placed it on. With `--preload`, its
    worker is forked by the node's zygote (`node_zygote.NodeZygote`), which this actor
    asks to start, wait for and signal it."""

    started: dict[str, Any]
    node: Any = None  # the node's zygote actor, with --preload

    def __init__(self) -> None:
        super().__init__()
        self.asked = threading.Event()
        threading.Thread(target=self._end_when_unasked, daemon=True).start()

    def _end_when_unasked(self) -> None:
        if not self.asked.wait(UNASKED_AFTER):
            os._exit(0)

    def start_here(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        near: tuple[str, str],
        preload: list[str] | None = None,
    ) -> dict[str, Any]:
        """Start the worker on this node; `near` is gym-proxy's node and runtime
        directory: on that node, the worker listens in that directory. `preload`: the
        node zygote's name prefix, then the app, its directory and the head limits."""
        import ray  # only on a node, in Ray's worker process

        self.asked.set()
        node_id = ray.get_runtime_context().get_node_id()
        unix_dir = near[1] if node_id == near[0] else ""
        host = ray.util.get_node_ip_address()
        if preload:
            self.node = _node_zygote(ray, node_id, preload, env)
            started = dict(ray.get(self.node.start.remote(argv, env, host, cwd, unix_dir)))
            self.pid, self.path = started["pid"], started["path"]
        else:
            started = self.start(argv, env, host, cwd, unix_dir)
        started["node_id"] = node_id
        started["hostname"] = socket.gethostname()
        self.started = started
        threading.Thread(target=self._end_when_orphaned, daemon=True).start()
        return started

    def wait(self) -> int:
        if self.node is None:
            return super().wait()
        import ray

        try:
            code = int(ray.get(self.node.wait.remote(self.pid)))
        except ray.exceptions.RayActorError:  # the node's zygote actor is gone: so is its worker
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)
            code = EXIT_UNKNOWN
        self._unlink()
        return code

    def signal(self, sig: int) -> None:
        if self.node is None:
            super().signal(sig)
        else:
            self.node.signal.remote(self.pid, sig)

    def where(self) -> dict[str, Any]:
        """What `start_here` answered: for a driver that follows this actor."""
        return self.started

    def _end_when_orphaned(self) -> None:
        """The actor is detached (it outlives its driver): a driver that hears its worker's
        exit kills it at once; one still alive ORPHANED_AFTER seconds after the exit has
        no driver to hear it (a `wait` a dead driver asked for still returns here), and
        ends itself, so that gym-proxy and its driver both gone leave no actor."""
        if self.node is None:
            self.wait()
        else:
            self._node_wait()
        time.sleep(ORPHANED_AFTER)
        os._exit(0)

    def _node_wait(self) -> None:
        """Until the worker the node's zygote forked is gone (a pidfd: it is not this
        process's child, and its exit code is the zygote's to read)."""
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)


def _node_zygote(ray: Any, node_id: str, preload: list[str], env: dict[str, str]) -> Any:
    """The node's zygote actor for this server: found, or made (the first worker here)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    kept, *args = preload
    return (
        ray.remote(NodeZygote)
        .options(
            name=name_of(kept, node_id), get_if_exists=True, lifetime="detached",
            num_cpus=0, max_concurrency=1024, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(args, env)
    )  # fmt: skip
