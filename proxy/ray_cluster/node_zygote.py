"""`--preload` on a Ray cluster: one zygote per node, so that the app is imported once
per node and every placed worker there is forked from it.

`NodeZygote` is a Ray actor, one per node and server: named after gym-proxy's runtime
directory and the node (`name_of`), detached, pinned to its node, reserving nothing (the
workers' own actors hold their resources). The first worker's actor on a node creates
it (`get_if_exists`: the others find it); it starts the zygote (`worker.zygote`, as a
local `--preload` does) with the workers' environment, and forks each placed worker of
the node from it: the worker's actor (`worker_host.RayWorkerHost`) asks it to `start`
the worker on a port it binds here and hands to the zygote with the fork (SCM_RIGHTS),
then `wait`s for its exit code (the zygote's child: only the zygote can reap it) and
`signal`s it through here.

It ends itself IDLE_AFTER seconds after its last worker exited (none asked for since),
and with it the zygote, whose pair's end closes; the placement driver's stop kills it
too. If the zygote dies, nothing it forked can be waited for: each of its workers is
killed and reported exited (`EXIT_UNKNOWN`), and the next fork starts a new zygote, as
the local `--preload` does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from gym_proxy.coordinator.contract.exit_codes import EXIT_UNKNOWN
from gym_proxy.coordinator.contract.lines import LineError, decode_line, encode_line
from gym_proxy.coordinator.contract.worker_link import LINK_KEY_ENV
from gym_proxy.coordinator.contract.zygote_lines import (
    ZYGOTE,
    ChildExited,
    Fork,
    Forked,
    ForkRefused,
)
from gym_proxy.proxy.ray_cluster.worker_port import bind_port

__all__ = ["NodeZygote", "name_of", "IDLE_AFTER"]

IDLE_AFTER = 10.0  # seconds without a worker after which a node's zygote ends


def name_of(kept: str, node_id: str) -> str:
    """The node zygote's actor name: gym-proxy's runtime directory's, then the node's."""
    return f"{kept}-node-{node_id}"


class NodeZygote:
    """The actor (module docstring): `start`, `wait` and `signal` a worker by its pid."""

    def __init__(self, preload: list[str], env: dict[str, str]) -> None:
        self.preload = preload  # app, app_dir, limit_line, limit_headers
        # The app is imported here: the link key (which each forked worker gets with its
        # fork, and removes) is not in the zygote's environment for it to read.
        self.env = {k: v for k, v in {**os.environ, **env}.items() if k != LINK_KEY_ENV}
        self.lock = threading.Lock()  # one fork at a time: answers come in order
        self.changed = threading.Condition()
        self.exits: dict[int, int] = {}
        self.children: set[int] = set()
        self.answer: Forked | ForkRefused | None = None
        self.conn: socket.socket | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.idle_since = time.monotonic()
        threading.Thread(target=self._end_when_idle, daemon=True).start()

    def start(
        self, argv: list[str], env: dict[str, str], host: str, cwd: str, unix_dir: str
    ) -> dict[str, Any]:
        """Fork a worker listening on a port bound here (`worker_port.bind_port`): its
        pid and the port."""
        sock, path = bind_port(host, unix_dir)
        with sock, self.lock:
            if self.conn is None:
                self._start_zygote()
            assert self.conn is not None
            with self.changed:
                self.answer = None
            fork = Fork([*argv, "--socket=fd:{fd}", "--coordinator=accept"], env, True, cwd)
            socket.send_fds(self.conn, [encode_line(fork)], [sock.fileno()])
            with self.changed:
                self.changed.wait_for(lambda: self.answer is not None or self.conn is None)
                answer = self.answer
            port = 0 if path else sock.getsockname()[1]
        if not isinstance(answer, Forked):
            why = answer.error if isinstance(answer, ForkRefused) else "the zygote exited"
            raise RuntimeError(f"--preload cannot fork a worker on this node: {why}")
        return {"pid": answer.pid, "host": host, "port": port, "path": path}

    def _start_zygote(self) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-m", "gym_proxy.worker.zygote", str(theirs.fileno()),
                 *self.preload],
                pass_fds=(theirs.fileno(),), env=self.env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        self.conn = ours
        threading.Thread(target=self._read, args=(ours,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            with conn.makefile("rb") as lines:
                for line in lines:
                    said = decode_line(line, ZYGOTE, "the node's zygote")
                    with self.changed:
                        if isinstance(said, ChildExited):
                            self.exits[said.pid] = said.code
                            self.children.discard(said.pid)
                        elif isinstance(said, Forked):
                            self.children.add(said.pid)
                            self.answer = said
                        elif isinstance(said, ForkRefused):
                            self.answer = said
                        self.changed.notify_all()
        except (OSError, LineError) as exc:
            print(f"gym-proxy node zygote: {exc}; taken as gone", file=sys.stderr, flush=True)
        self._lost()

    def _lost(self) -> None:
        """The zygote is gone: its workers cannot be waited for any more (module doc)."""
        with self.changed:
            self.conn = None
            for pid in self.children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.exits.setdefault(pid, EXIT_UNKNOWN)
            self.children.clear()
            self.changed.notify_all()
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)

    def wait(self, pid: int) -> int:
        """The worker's exit code, once it exited."""
        with self.changed:
            self.changed.wait_for(lambda: pid in self.exits)
            if not self.children:
                self.idle_since = time.monotonic()
            return self.exits.pop(pid)

    def signal(self, pid: int, sig: int) -> None:
        with self.changed:
            if pid in self.children:
                os.kill(pid, sig)

    def zygote_pid(self) -> int:
        """The zygote's pid, 0 before the first fork (for tests and `status` readers)."""
        return self.process.pid if self.process is not None else 0

    def _end_when_idle(self) -> None:
        while True:
            time.sleep(1.0)
            with self.changed:
                idle = not self.children and not self.lock.locked()
                if not idle:
                    self.idle_since = time.monotonic()
                elif time.monotonic() - self.idle_since > IDLE_AFTER:
                    break
        os._exit(0)  # the zygote's end of the pair closes with this process: it exits
