"""The three ways bench/ray_verifier.py serves NeMo Gym's released code_gen resources
server (`resources_servers.code_gen.app:CompCodingResourcesServer`, whose /verify runs
the submitted program's unit tests as a Ray task), each as its own processes:

- `one`: one process as NeMo Gym runs it, `python app.py` in the server's directory with
  the config in `NEMO_GYM_CONFIG_DICT`/`NEMO_GYM_CONFIG_PATH`; no cluster is named, so
  NeMo Gym's `initialize_ray()` starts one;
- `nemo-gym`: NeMo Gym's own multi-worker path under NeMo Gym's launcher, `gym env start`
  with `num_workers: 2` in the instance's config: the launcher starts one cluster and
  names it in the config it hands down, the server's main process runs `uvicorn.run(
  "<module>:app", workers=2)`. code_gen's app.py cannot be that module as released
  (bench/nemo_gym_code_gen_workers.py says why), so the server directory is one of the
  bench's own holding that module, the class still code_gen's; the server's venv is this
  one (a symlink, as tests/test_nemo_gym_launcher.py gives the launcher);
- `gym-proxy`: `gym-proxy <class> --nemo-gym-config FILE --workers 2`, which starts one
  cluster for its workers (proxy/ray_cluster/cluster.py).

Each way is the leader of a session of its own: bench/ray_verifier_procs.py finds all its
processes from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import nemo_gym  # the NeMo Gym tier's virtualenv (tests/nemo_gym/install.sh)

from bench.ray_verifier_procs import Snapshot, snapshot
from bench.servers import free_port

__all__ = ["WAYS", "Way"]

HERE = Path(__file__).resolve().parent
PACKAGES = Path(nemo_gym.__file__).resolve().parent.parent  # site-packages: the servers
CODE_GEN = PACKAGES / "resources_servers" / "code_gen"
SERVER_CLASS = "resources_servers.code_gen.app:CompCodingResourcesServer"
INSTANCE = "code_gen"
WORKERS = 2
START_WITHIN = 300.0  # seconds: a Ray cluster and the workers, on 2 busy cores
STOP_WITHIN = 30.0


@dataclass
class Way:
    """One way of serving the server: its config, its command, its processes."""

    key: ClassVar[str]
    label: ClassVar[str]
    stop_signal: ClassVar[signal.Signals] = signal.SIGINT
    directory: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    ray_sessions: set[str] = field(default_factory=set)

    # ---- what each way is -------------------------------------------------------------
    def server_block(self) -> dict[str, Any]:
        """The instance's config as code_gen's configs/code_gen.yaml has it."""
        return {
            "entrypoint": "app.py",
            "host": "127.0.0.1",
            "port": self.port,
            "domain": "coding",
            "num_processes": 8,
            "unit_test_timeout_secs": 10,
            "debug": False,
        }

    def global_config(self) -> dict[str, Any]:
        return {
            "head_server": {"host": "127.0.0.1", "port": free_port()},
            "dry_run": False,
            INSTANCE: {"resources_servers": {"code_gen": self.server_block()}},
        }

    def command(self) -> list[str]:
        raise NotImplementedError

    def cwd(self) -> Path:
        return self.directory

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # no way joins a cluster the bench's shell may name
        return env

    def log_says_ready(self, log: str) -> bool:
        return True

    # ---- its processes -----------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.directory / "config.yaml"

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(self.global_config()))  # JSON is YAML
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(), cwd=self.cwd(), env=self.environment(), stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own session: every process it starts is in it
            )  # fmt: skip

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_ready(self, http: aiohttp.ClientSession) -> None:
        """Until /health answers 200 and the log says every worker is up."""
        assert self.proc is not None
        deadline = time.monotonic() + START_WITHIN
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited:\n{self.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{self.url}/health") as resp:
                    if resp.status == 200 and self.log_says_ready(self.log()):
                        return
            await asyncio.sleep(0.5)  # polling a process that gives no other signal
        raise RuntimeError(f"{self.label} not ready in {START_WITHIN:g} s:\n{self.log_tail()}")

    def snapshot(self) -> Snapshot:
        return snapshot(self.pid, self.ray_sessions)

    def stop(self) -> None:
        """Its own way of stopping (Ctrl-C, or SIGTERM for gym-proxy), then SIGKILL to
        whatever of its processes is left (found as its snapshot finds them)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_WITHIN)
        for pid in self.snapshot().procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self) -> str:
        return self.log()[-4000:]


class OneProcess(Way):
    key = "one"
    label = "one NeMo Gym process"

    def command(self) -> list[str]:
        return [sys.executable, "app.py"]

    def cwd(self) -> Path:
        return CODE_GEN

    def environment(self) -> dict[str, str]:
        return {
            **super().environment(),
            "NEMO_GYM_CONFIG_DICT": self.config_path.read_text(),
            "NEMO_GYM_CONFIG_PATH": INSTANCE,
        }


class NemoGymWorkers(Way):
    key = "nemo-gym"
    label = f"NeMo Gym num_workers: {WORKERS} (launcher)"
    server_dir = "code_gen_workers"

    def server_block(self) -> dict[str, Any]:
        return {**super().server_block(), "num_workers": WORKERS}

    def global_config(self) -> dict[str, Any]:
        config = super().global_config()
        config[INSTANCE] = {"resources_servers": {self.server_dir: self.server_block()}}
        config["uv_venv_dir"] = str(self.directory / "venvs")
        config["skip_venv_if_present"] = True
        return config

    def start(self) -> None:
        server = self.directory / "resources_servers" / self.server_dir
        server.mkdir(parents=True, exist_ok=True)
        shutil.copy(HERE / "nemo_gym_code_gen_workers.py", server / "app.py")
        # The launcher takes a directory with requirements.txt (or pyproject.toml) for a
        # server; with skip_venv_if_present and a venv present it installs nothing.
        (server / "requirements.txt").write_text("")
        venv = self.directory / "venvs" / "resources_servers" / self.server_dir / ".venv"
        venv.parent.mkdir(parents=True, exist_ok=True)
        if not venv.exists():
            venv.symlink_to(sys.prefix)  # the server's venv: this one
        super().start()

    def command(self) -> list[str]:
        gym = Path(sys.executable).parent / "gym"
        return [str(gym), "env", "start", f"+config_paths=[{self.config_path}]"]

    def environment(self) -> dict[str, str]:
        # The uvicorn workers import resources_servers.code_gen_workers.app (a namespace
        # package: the directory's one joins site-packages'), which imports code_gen's.
        return {**super().environment(), "PYTHONPATH": f"{self.directory}:{CODE_GEN}"}

    def log_says_ready(self, log: str) -> bool:
        return (
            "All 1 / 1 servers ready" in log
            and log.count("Application startup complete.") >= WORKERS
        )


class GymProxy(Way):
    key = "gym-proxy"
    label = f"gym-proxy --workers {WORKERS}"
    stop_signal = signal.SIGTERM

    def command(self) -> list[str]:
        gym_proxy = Path(sys.executable).parent / "gym-proxy"
        return [
            str(gym_proxy), SERVER_CLASS, "--nemo-gym-config", str(self.config_path),
            "--workers", str(WORKERS), "--log-level", "warning",
        ]  # fmt: skip


WAYS: dict[str, type[Way]] = {cls.key: cls for cls in (OneProcess, NemoGymWorkers, GymProxy)}
