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
has ended it within ORPHANED_AFTER seconds.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["WorkerHost", "RayWorkerHost", "WORKER_COMMAND", "private_directory"]

WORKER_COMMAND = (sys.executable, "-P", "-m", "gym_proxy.worker")
BACKLOG = 4096  # as a local worker's socket (`worker.identity.WORKER_BACKLOG`)
ORPHANED_AFTER = 10.0  # seconds an exited worker's actor waits for a driver to end it
UNIX_PATH_MAX = 100  # sun_path holds 108 bytes; a longer runtime directory: TCP
SOCKET_PREFIX = "placed-"  # never "w…sock": those are the local workers' (adoption)


def private_directory(path: str) -> bool:
    """Whether `path` is a directory of this user that no one else may enter (gym-proxy's
    runtime directory, as this process sees it): only then is a socket in it private."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and stat.S_IMODE(info.st_mode) & 0o077 == 0
    )


class WorkerHost:
    """Start one worker, on a Unix socket in `unix_dir` or a TCP port of `host`, wait
    for it, signal it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.path = ""

    def start(
        self, argv: list[str], env: dict[str, str], host: str, cwd: str = "", unix_dir: str = ""
    ) -> dict[str, Any]:
        """Bind the port (a Unix socket in `unix_dir` when it is given, private and short
        enough; else TCP on `host`), start the worker with it (in `cwd` when the node has
        that directory, as a local worker runs in the proxy's); its pid and the port."""
        sock = self._unix(unix_dir) or socket.create_server((host, 0), backlog=BACKLOG)
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

    def _unix(self, directory: str) -> socket.socket | None:
        if not directory or not private_directory(directory):
            return None
        path = os.path.join(directory, f"{SOCKET_PREFIX}{secrets.token_hex(8)}.sock")
        if len(path.encode()) > UNIX_PATH_MAX:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            return None
        self.path = path
        return sock

    def wait(self) -> int:
        """The worker's exit status, once it exits (negative: the signal that ended it);
        its Unix socket's file goes with it."""
        assert self.process is not None
        code = self.process.wait()
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        return code

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(sig)


class RayWorkerHost(WorkerHost):
    """The actor: a `WorkerHost` on the node Ray placed it on."""

    started: dict[str, Any]

    def start_here(
        self, argv: list[str], env: dict[str, str], cwd: str, near: tuple[str, str]
    ) -> dict[str, Any]:
        """Start the worker on this node; `near` is gym-proxy's node and runtime
        directory: on that node, the worker listens in that directory."""
        import ray  # only on a node, in Ray's worker process

        node_id = ray.get_runtime_context().get_node_id()
        unix_dir = near[1] if node_id == near[0] else ""
        started = self.start(argv, env, ray.util.get_node_ip_address(), cwd, unix_dir)
        started["node_id"] = node_id
        started["hostname"] = socket.gethostname()
        self.started = started
        threading.Thread(target=self._end_when_orphaned, daemon=True).start()
        return started

    def where(self) -> dict[str, Any]:
        """What `start_here` answered: for a driver that follows this actor."""
        return self.started

    def _end_when_orphaned(self) -> None:
        """The actor is detached (it outlives its driver): a driver that hears its worker's
        exit kills it at once; one still alive ORPHANED_AFTER seconds after the exit has
        no driver to hear it (a `wait` a dead driver asked for still returns here), and
        ends itself, so that gym-proxy and its driver both gone leave no actor."""
        assert self.process is not None
        self.process.wait()
        time.sleep(ORPHANED_AFTER)
        os._exit(0)
