"""The reference stack: weather, fake_model, simple_agent and single_turn, each behind its
own gym-proxy with N workers, found by each other through `GYM_REF_<NAME>_URL`.

    gym-proxy-stack --workers 2            # prints the four URLs; Ctrl-C stops it

`Stack` is the same thing as a library (the end-to-end tests and the scale bench use
it): ports are chosen once and kept, so a stack killed with `kill()` (SIGKILL to every
process group, as a crashed node) and started again answers at the same addresses, with
the same secret: tokens and the clients' stored URLs stay valid.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SERVERS", "Stack", "main"]

REPO = Path(__file__).resolve().parents[2]
# name -> APP; the order is the prepare order NeMo Gym uses (callers first)
SERVERS = {
    "env": "gym_proxy.worker.apps.single_turn:create_app",
    "model": "gym_proxy.worker.apps.fake_model:create_app",
    "agent": "gym_proxy.worker.apps.simple_agent:create_app",
    "weather": "gym_proxy.worker.apps.weather:create_app",
}


def free_ports(host: str, count: int) -> list[int]:
    """`count` different ports free on `host`: the probes are held until all are chosen."""
    with contextlib.ExitStack() as held:
        probes = [held.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind((host, 0))
        return [probe.getsockname()[1] for probe in probes]


@dataclass
class Server:
    name: str
    app: str
    port: int
    workers: int
    proc: subprocess.Popen[bytes] | None = None


class Stack:
    """Four gym-proxies on fixed loopback ports, restartable after a kill."""

    def __init__(
        self,
        workers: int | dict[str, int] = 1,
        directory: str | None = None,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        ports: list[int] | None = None,
    ) -> None:
        """`ports`, one per server in SERVERS' order, default to ports free now."""
        self.host = host
        self.dir = Path(directory or tempfile.mkdtemp(prefix="gps-", dir="/tmp"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        # gym-proxy's private sockets: a short path of its own (AF_UNIX paths are short)
        self.runtime = tempfile.mkdtemp(prefix="gsr-", dir="/tmp")
        ports = ports or free_ports(host, len(SERVERS))
        self.servers = {
            name: Server(name, app, port, self._count(workers, name))
            for (name, app), port in zip(SERVERS.items(), ports, strict=True)
        }
        self.control_token = secrets.token_urlsafe(24)
        self._secret_file = self._private("secret", secrets.token_urlsafe(32))
        self._token_file = self._private("control-token", self.control_token)

    @staticmethod
    def _count(workers: int | dict[str, int], name: str) -> int:
        return workers if isinstance(workers, int) else workers.get(name, 1)

    def _private(self, name: str, value: str) -> str:
        path = self.dir / name
        path.write_text(value)
        path.chmod(0o600)
        return str(path)

    @property
    def urls(self) -> dict[str, str]:
        return {name: f"http://{self.host}:{s.port}" for name, s in self.servers.items()}

    def start(self, workers: int | dict[str, int] | None = None) -> Stack:
        """Start every server (with new worker counts, if given) and wait until each
        answers its control plane."""
        urls = self.urls
        env = {
            **os.environ,
            **self.env,
            "GYM_REF_WEATHER_URL": urls["weather"],
            "GYM_REF_MODEL_URL": urls["model"],
            "GYM_REF_AGENT_URL": urls["agent"],
        }
        for server in self.servers.values():
            if workers is not None:
                server.workers = self._count(workers, server.name)
            log = open(self.dir / f"{server.name}.log", "ab")  # noqa: SIM115
            server.proc = subprocess.Popen(
                [sys.executable, "-m", "gym_proxy", server.app, "--workers", str(server.workers),
                 "--host", self.host, "--port", str(server.port), "--name", server.name,
                 "--secret-file", self._secret_file, "--control-token-file", self._token_file,
                 "--runtime-dir", self.runtime, "--log-level", "warning"],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,  # its own process group
            )  # fmt: skip
            log.close()
        for server in self.servers.values():
            self._wait_ready(server)
        return self

    def _wait_ready(self, server: Server, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        while True:
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited: {self.log(server.name)[-2000:]}")
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection(self.host, server.port, timeout=2)
                try:
                    conn.request(
                        "GET",
                        "/ng-control/v1/checkpoint/status",
                        headers={"Authorization": f"Bearer {self.control_token}"},
                    )
                    reply = conn.getresponse()
                    if reply.status == 200:
                        status = json.loads(reply.read())
                        if len(status["workers"]) == status["expected_workers"]:
                            return
                finally:
                    conn.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} did not start: {self.log(server.name)[-2000:]}")
            time.sleep(0.05)

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL every server's process group (proxy and workers): a crash."""
        for server in self.servers.values():
            if server.proc is not None and server.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.proc.pid, signal.SIGKILL)
            if server.proc is not None:
                server.proc.wait()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.proc.pid, signal.SIGKILL)  # a worker left behind

    def stop(self) -> None:
        """SIGTERM every server (they drain), SIGKILL what is left after 30 s."""
        for server in self.servers.values():
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
        for server in self.servers.values():
            if server.proc is None:
                continue
            try:
                server.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGKILL)

    def remove(self) -> None:
        """Delete the stack's directory and its runtime directory (after stop or kill)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.runtime, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="gym-proxy-stack",
        description="Start the reference stack, each server behind gym-proxy.",
    )
    parser.add_argument("--workers", type=int, default=2, help="workers per server")
    parser.add_argument("--dir", help="where logs, the secret and the control token live")
    opts = parser.parse_args(argv)
    stack = Stack(opts.workers, opts.dir).start()
    for name, url in stack.urls.items():
        print(f"{name:8} {url}")
    print(f"control token: {stack.dir / 'control-token'}   logs: {stack.dir}", flush=True)
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while not stopping:
        signal.pause()
    stack.stop()
    shutil.rmtree(stack.runtime, ignore_errors=True)


if __name__ == "__main__":
    main()
