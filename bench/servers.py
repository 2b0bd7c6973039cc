"""The front ends the routing bench compares, started as real processes.

All of them serve the same app, the ASGI counter (`bench/asgi_counter.py`):

- gym-proxy with N uvicorn workers;
- the same workers reached directly over their Unix sockets (the limit);
- HAProxy with cookie stickiness to those same worker sockets (if installed);
- the port-sharing design: `uvicorn --workers N` on one port with an in-worker router
  (`bench/port_sharing.py`).
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TICK = os.sysconf("SC_CLK_TCK")


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of one process."""
    return sum(cpu_split(pid))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", path, body=b'{"count": 1}', headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def wait_answering(
    port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            # typed, for a FastAPI app (NeMo Gym's counter validates the body as JSON)
            if post(port, "/increment_counter", {"Content-Type": "application/json"})[0] == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.05)


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server drains and stops its workers), SIGKILL after 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class FrontEnd:
    """One way to reach the app: where clients connect, what each session sends, and
    which processes to charge CPU to (the front end's own, and all of the server's)."""

    name: str
    targets: list[dict[str, str]]
    sessions: list[tuple[int, str]]
    front_pids: list[int] = field(default_factory=list)
    server_pids: list[int] = field(default_factory=list)

    def plan(self, directory: str) -> str:
        path = Path(directory) / f"{self.name}.json"
        body = {"targets": self.targets, "path": "/increment_counter", "sessions": self.sessions}
        path.write_bytes(orjson.dumps(body))
        return str(path)


class GymProxy:
    """gym-proxy with `workers` ASGI counter workers."""

    def __init__(
        self,
        workers: int,
        *extra: str,
        local: bool = True,
        app: str = "asgi_counter:app",
        env: dict[str, str] | None = None,
    ) -> None:
        """`local`: its workers listen on Unix sockets here (not placed on Ray's nodes);
        `app`: a module of bench/; `env`: added to gym-proxy's environment."""
        self.runtime = tempfile.mkdtemp(prefix="gpb-", dir="/tmp")
        self.port = free_port()
        self.log = Path(self.runtime) / "proxy.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gym_proxy", app, "--app-dir", str(HERE),
                 "--workers", str(workers), "--port", str(self.port), "--runtime-dir",
                 self.runtime, "--log-level", "warning", "--secret", "bench", *extra],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            )  # fmt: skip
        try:
            wait_answering(self.port, self.proc, f"gym-proxy (see {self.log})")
        except BaseException:  # a server that never answered is not left running
            terminate(self.proc)
            raise
        deadline = time.monotonic() + 30
        while local and len(self.sockets()) < workers and time.monotonic() < deadline:
            time.sleep(0.05)

    def sockets(self) -> list[str]:
        return sorted(str(p) for p in Path(self.runtime).glob("gym-proxy-*/w*.sock"))

    def workers(self) -> list[int]:
        return children(self.proc.pid)

    def front_end(self, sessions: int) -> FrontEnd:
        seeded = []
        for _ in range(sessions):
            _, headers, _ = post(self.port, "/seed_session")
            seeded.append(
                (0, f"x-nemo-gym-session-token: {headers['x-nemo-gym-session-token']}\r\n")
            )
        pids = [self.proc.pid]
        return FrontEnd(
            "gym-proxy", [{"tcp": f"127.0.0.1:{self.port}"}], seeded, pids, pids + self.workers()
        )

    def direct(self, sessions: int) -> FrontEnd:
        """Straight to the workers: each connection to one socket, carrying sessions
        that worker holds (the client knows the owner; nothing routes)."""
        sockets = self.sockets()
        seeded = [(i % len(sockets), f"x-ng-session-id: direct-{i}\r\n") for i in range(sessions)]
        targets = [{"unix": path} for path in sockets]
        return FrontEnd("direct", targets, seeded, [], self.workers())

    def stop(self) -> None:
        terminate(self.proc)
        shutil.rmtree(self.runtime, ignore_errors=True)


class HAProxy:
    """HAProxy (one thread, like gym-proxy's one event loop) with cookie stickiness
    (`cookie GPW insert indirect`) to gym-proxy's worker sockets."""

    def __init__(self, sockets: list[str], workers: list[int], connections: int) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="gph-", dir="/tmp")
        servers = "\n".join(
            f"  server w{i} unix@{path} cookie w{i}" for i, path in enumerate(sockets)
        )
        config = Path(self.dir) / "haproxy.cfg"
        config.write_text(
            f"global\n  maxconn {connections + 100}\n  nbthread 1\n"
            "defaults\n  mode http\n  timeout connect 5s\n  timeout client 60s\n"
            "  timeout server 60s\n  option http-keep-alive\n"
            f"frontend fe\n  bind 127.0.0.1:{self.port}\n  default_backend workers\n"
            "backend workers\n  http-reuse always\n  cookie GPW insert indirect nocache\n"
            f"{servers}\n"
        )
        self.count = len(sockets)
        self.workers = workers
        self.proc = subprocess.Popen(
            ["haproxy", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_answering(self.port, self.proc, "haproxy")

    @staticmethod
    def installed() -> bool:
        return shutil.which("haproxy") is not None

    def front_end(self, sessions: int) -> FrontEnd:
        seeded = [
            (0, f"cookie: GPW=w{i % self.count}\r\nx-ng-session-id: hap-{i}\r\n")
            for i in range(sessions)
        ]
        pids = [self.proc.pid]
        return FrontEnd(
            "haproxy", [{"tcp": f"127.0.0.1:{self.port}"}], seeded, pids, pids + self.workers
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class PortSharing:
    """`uvicorn --workers N` on one port, with the in-worker router."""

    def __init__(self, workers: int) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="gps-", dir="/tmp")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "port_sharing:app", "--app-dir", str(HERE),
             "--workers", str(workers), "--port", str(self.port), "--loop", "uvloop",
             "--http", "httptools", "--no-access-log", "--log-level", "warning"],
            cwd=REPO, env={**os.environ, "GYM_BENCH_SHARE_DIR": self.dir},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_answering(self.port, self.proc, "uvicorn --workers")
        deadline = time.monotonic() + 30
        while len(list(Path(self.dir).glob("*.sock"))) < workers:
            if time.monotonic() > deadline:
                raise SystemExit("uvicorn workers did not open their router sockets")
            time.sleep(0.05)

    def front_end(self, sessions: int) -> FrontEnd:
        seeded = []
        for _ in range(sessions):
            _, _, body = post(self.port, "/seed_session")
            seeded.append((0, f"x-ng-session-id: {orjson.loads(body)['session_id']}\r\n"))
        pids = [self.proc.pid, *children(self.proc.pid)]
        return FrontEnd("port-sharing", [{"tcp": f"127.0.0.1:{self.port}"}], seeded, [], pids)

    def stop(self) -> None:
        terminate(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
