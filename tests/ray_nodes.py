"""A Ray cluster of several real nodes on this machine, for the NeMo Gym tier: one
`ray start --head` and `ray start --address` per further node, each `--block` in a process
group of its own (its raylet, agents and Ray workers are its descendants), with its own
ports and temp dir, one CPU each; and a driver joined to it that answers Ray's state API
(`tests/nemo_gym/ray_state.py`).

Token authentication is on, set on every node as Ray's docs ask for a cluster started
with `ray start`: Ray 2.60's `ray start --head` turns it on by itself only when it finds
a token (`~/.ray/auth_token`, `RAY_AUTH_TOKEN_PATH`, `RAY_AUTH_TOKEN`) and
`RAY_AUTH_MODE` is unset, and `ray start --address` never does. The token is the
cluster's own, in a file under its directory (`token_path`).

The GCS checks each node's health every second and declares it dead after 3 misses
(Ray's default: every 3 s, 5 misses), so a node that vanishes is known within seconds.

`start_autoscaling_head` starts the head with Ray's autoscaler on its fake multi-node
provider, as `ray.cluster_utils.AutoscalingCluster` does (Ray's own autoscaling tests),
without its `ray stop --force` (which would stop every cluster of the host) and with the
config its released wheel lacks (`fake_multi_node/example.yaml` is not packaged): the
autoscaler adds nodes of `worker_types` for pending actors, each a raylet started by the
head's monitor (so a descendant of the head's `ray start`), and removes them once idle.

Every process is ended by pid: `kill_node` SIGKILLs a node's whole tree at once (a
machine gone), `stop` does so for every node. Nothing here calls `ray stop`, which
would stop every Ray cluster on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tests.ports import free_port
from tests.support import REPO, wait_until_sync

RAY = str(Path(sys.executable).with_name("ray"))  # the venv's `ray` command
STARTED = "Ray runtime started"  # what `ray start` prints once its node has joined
OBJECT_STORE = 100 * 2**20  # bytes per node (Ray's floor is 75 MiB)
HEALTH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


@dataclass
class RayNode:
    """One `ray start --block` process: a node of the cluster."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def processes(self) -> list[psutil.Process]:
        """The node's processes: `ray start` and its descendants (Ray workers start
        sessions of their own, so the process group alone does not hold them)."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def running(self, title: str) -> bool:
        """Whether a Ray worker of this node is running a task named `title` (Ray sets
        a worker's process title to `ray::<task>` while it runs one)."""
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                if proc.cmdline()[:1] == [f"ray::{title}"]:
                    return True
        return False

    def kill(self) -> None:
        """SIGKILL every process of the node at once (taken before any dies, so none
        is left behind by its parent dying first), then reap and wait for all."""
        procs = self.processes()
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        _, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, f"{self.name}: still alive after SIGKILL: {alive}"


class RayNodes:
    """The cluster: `start_head`, `add_node`, `kill_node`, `stop` (module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory  # short (socket paths under it must fit sockaddr_un)
        self.token_path = directory / "token"
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[RayNode] = []
        self.autoscaling: dict[str, str] = {}  # the head's autoscaler's environment

    @property
    def environment(self) -> dict[str, str]:
        """What a process needs to join: token mode and where the token is."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    def start_head(self, resources: dict[str, float] | None = None) -> RayNode:
        """The head; `resources`: custom resources it offers (a worker asking for one is
        placed there)."""
        return self._start("head", ["--head", "--port", str(self.port),
                                    "--include-dashboard", "true",  # the state API's server
                                    "--dashboard-host", "127.0.0.1",
                                    "--dashboard-port", str(free_port())],
                           resources)  # fmt: skip

    def start_autoscaling_head(
        self, cpus: float, worker_types: dict[str, dict[str, Any]], idle_minutes: float = 0.1
    ) -> RayNode:
        """The head (`cpus` CPUs), with an autoscaler that adds nodes of `worker_types`
        (Ray's `available_node_types`: resources, min_workers, max_workers) and removes
        them after `idle_minutes` idle (module docstring)."""
        config = {
            "cluster_name": "gym-proxy-test", "max_workers": sum(
                int(t.get("max_workers", 0)) for t in worker_types.values()),
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                         "disable_node_updaters": True, "disable_launch_config_check": True,
                         "gcs_address": self.address},
            "available_node_types": {
                **{name: {"node_config": {}, "min_workers": 0, **kind}
                   for name, kind in worker_types.items()},
                "ray.head.default": {"resources": {"CPU": cpus}, "node_config": {},
                                     "max_workers": 0},
            },
            "head_node_type": "ray.head.default", "upscaling_speed": 1.0,
            "idle_timeout_minutes": idle_minutes, "auth": {}, "docker": {},
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        }  # fmt: skip
        path = self.directory / "autoscaling.json"
        path.write_text(json.dumps(config))
        self.autoscaling = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        return self._start("head", ["--head", "--port", str(self.port),
                                    "--autoscaling-config", str(path),
                                    "--include-dashboard", "true",
                                    "--dashboard-host", "127.0.0.1",
                                    "--dashboard-port", str(free_port())],
                           cpus=cpus)  # fmt: skip

    def add_node(self, resources: dict[str, float] | None = None) -> RayNode:
        return self._start(f"node{len(self.nodes)}", ["--address", self.address], resources)

    def _start(
        self,
        name: str,
        role: list[str],
        resources: dict[str, float] | None = None,
        cpus: float = 1,
    ) -> RayNode:
        if resources:
            role = [*role, "--resources", json.dumps(resources)]
        # Every port its own: several nodes (and other people's clusters) share the host.
        ports = ["--node-manager-port", "--object-manager-port", "--metrics-export-port",
                 "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                 "--runtime-env-agent-port"]  # fmt: skip
        command = [
            RAY, "start", "--block", *role, "--num-cpus", f"{cpus:g}",
            "--object-store-memory", str(OBJECT_STORE), "--temp-dir", str(self.directory / name),
            "--include-log-monitor", "false", "--disable-usage-stats",
            *(arg for flag in ports for arg in (flag, str(free_port()))),
        ]  # fmt: skip
        log_path = self.directory / f"{name}.log"
        with open(log_path, "wb") as log:  # the child has its own copy
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.environment, **HEALTH, **self.autoscaling,
                     "RAY_USAGE_STATS_ENABLED": "0"},
                start_new_session=True,
            )  # fmt: skip
        node = RayNode(name, proc, log_path)
        self.nodes.append(node)
        return node

    def wait_started(self, node: RayNode, within: float) -> None:
        def started() -> bool:
            if node.proc.poll() is not None:
                raise AssertionError(f"ray start ({node.name}) exited:\n{node.log()[-3000:]}")
            return STARTED in node.log()

        wait_until_sync(started, within, f"Ray node {node.name} to start")

    def stop(self) -> None:
        """Kill every node (the head last) and remove the cluster's directory."""
        for node in reversed(self.nodes):
            node.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


class RayState:
    """The state API driver (`tests/nemo_gym/ray_state.py`) joined to a cluster."""

    def __init__(self, nodes: RayNodes, within: float = 60) -> None:
        with open(nodes.directory / "state.log", "wb") as log:  # the child has its own copy
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.nemo_gym.ray_state", nodes.address],
                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env={**os.environ, **nodes.environment, "PYTHONPATH": str(REPO)},
                start_new_session=True,
            )  # fmt: skip
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.asking = threading.Lock()  # one question at a time, from any thread
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self._next(within)  # {"joined": ...}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(b"")  # EOF

    def _next(self, within: float) -> Any:
        try:
            line = self.lines.get(timeout=within)
        except queue.Empty:
            raise AssertionError(f"the state API driver did not answer in {within} s") from None
        assert line, "the state API driver exited"
        return json.loads(line)

    def ask(self, question: str, within: float = 30) -> Any:
        """The answer to `nodes` or `tasks NAME`."""
        assert self.proc.stdin is not None
        with self.asking:
            self.proc.stdin.write(question.encode() + b"\n")
            self.proc.stdin.flush()
            reply = self._next(within)
        assert not (isinstance(reply, dict) and "error" in reply), reply
        return reply

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.reader.join(10)  # it reads to EOF, which the exit gave it
        if self.proc.stdout is not None:
            self.proc.stdout.close()  # else a ResourceWarning fails whichever test GCs it
