"""NeMo Gym's own stack, for the NeMo Gym tier: four released servers, unmodified, wired
by one NeMo Gym global config and driven by NeMo Gym's rollout collection.

    environment  environment_servers/legacy_agent       relays /run to the agent
    agent        responses_api_agents/simple_agent       seeds, loops model <-> tools, verifies
    resources    resources_servers/example_session_state_mgmt   the stateful counter
                 (or resources_servers/structeval: STRUCTEVAL)
    model        responses_api_models/openai_model       calls the scripted policy backend

Each server runs behind its own `gym-proxy <its class> --workers N`, started as NeMo Gym's
launcher starts a server (`NEMO_GYM_CONFIG_DICT` and `NEMO_GYM_CONFIG_PATH` in the
environment, the server's directory as the working directory), or, as the reference,
as NeMo Gym runs it itself (`python app.py`: one uvicorn process). The backend behind the
model (`tests/nemo_gym/scripted_model.py`) stands where an LLM would.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import nemo_gym  # the tier's virtualenv has it (tests/nemo_gym/install.sh)
import orjson

from gym_proxy.coordinator.contract.lines import expect
from gym_proxy.proxy.ray_cluster.lines import HEAD, RAY_HEAD, ClusterAddress
from tests.ports import free_port
from tests.support import CONTROL_TOKEN, REPO, TEST_SECRET, wait_until

PACKAGES = Path(nemo_gym.__file__).resolve().parent.parent  # site-packages: the servers


@dataclass(frozen=True)
class ServerSpec:
    role: str
    instance: str
    app: str  # module:Class
    block: dict[str, Any]  # the instance's config beside host and port

    @property
    def server_type(self) -> str:
        return self.app.split(".")[0]

    @property
    def directory(self) -> Path:
        return PACKAGES.joinpath(*self.app.partition(":")[0].split(".")[:2])


WORKER_ACCESS = re.compile(r"worker (\d+) (\S+) (\d+) session=(\S+)")
MODEL = "policy_model"


def stack_specs(name: str, resources_app: str, resources_block: dict[str, Any]) -> list[ServerSpec]:
    """The four servers of a NeMo Gym stack around one resources server, named as NeMo
    Gym's own config files name them (`<name>_resources_server`, `<name>_simple_agent`,
    `<name>_environment_server`, `policy_model`)."""
    resources, agent = f"{name}_resources_server", f"{name}_simple_agent"
    return [
        ServerSpec(
            "env",
            f"{name}_environment_server",
            "environment_servers.legacy_agent.app:LegacyAgentEnvironmentServer",
            {"agent_server": {"type": "responses_api_agents", "name": agent}},
        ),
        ServerSpec(
            "agent",
            agent,
            "responses_api_agents.simple_agent.app:SimpleAgent",
            {
                "resources_server": {"type": "resources_servers", "name": resources},
                "model_server": {"type": "responses_api_models", "name": MODEL},
            },
        ),
        ServerSpec("resources", resources, resources_app, resources_block),
        ServerSpec(
            "model",
            MODEL,
            "responses_api_models.openai_model.app:SimpleModelServer",
            {
                "openai_base_url": "${policy_base_url}",
                "openai_api_key": "${policy_api_key}",
                "openai_model": "${policy_model_name}",
                "openai_default_headers": {},
                "drop_input_reasoning_items": False,
            },
        ),
    ]


SPECS = stack_specs(
    "example_session_state_mgmt",
    "resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer",
    {"domain": "agent", "verified": False, "description": "counter"},
)
# NeMo Gym's structeval_nonrenderable config: a verifier whose CPU is its own event loop's
# (tests/nemo_gym/structured.py), stateless
STRUCTEVAL = stack_specs(
    "structeval_nonrenderable",
    "resources_servers.structeval.app:StructEvalResourcesServer",
    {"domain": "instruction_following", "verified": False, "description": "structeval"},
)
TOOLS = [
    {
        "type": "function",
        "name": "increment_counter",
        "description": "",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"count": {"type": "integer", "description": ""}},
            "required": ["count"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "get_counter_value",
        "description": "",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {},
            "required": [],
            "additionalProperties": False,
        },
    },
]


class SharedRay:
    """One real Ray cluster for every stack of a test run, named in each stack's global
    config as NeMo Gym's launcher names its own (`ray_head_node_address`): the stack's
    servers that use Ray (`legacy_agent` does not set `ray_enabled`) join it rather than
    each starting one. Held by gym-proxy's own Ray process (`proxy.ray_cluster.head`), started on
    first use and stopped when the test process exits."""

    head: subprocess.Popen[bytes] | None = None
    reply: ClusterAddress | None = None

    @classmethod
    def get(cls) -> ClusterAddress:
        """The cluster's address and authentication mode, started now if it is not yet."""
        if cls.head is None or cls.head.poll() is not None:
            cls.stop()  # a head that died: its pipes closed before its successor starts
            cls.head = subprocess.Popen(
                [sys.executable, "-P", "-m", "gym_proxy.proxy.ray_cluster.head", "start"],
                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)},
            )  # fmt: skip
            assert cls.head.stdout is not None
            line = cls.head.stdout.readline()
            assert line, "the shared Ray cluster did not start"
            cls.reply = expect(line, RAY_HEAD, HEAD, ClusterAddress)
            atexit.register(cls.stop)
        assert cls.reply is not None
        return cls.reply

    @classmethod
    def stop(cls) -> None:
        head, cls.head = cls.head, None
        if head is not None and head.poll() is None:
            assert head.stdin is not None
            head.stdin.close()
            try:
                head.wait(30)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait()
        if head is not None and head.stdout is not None:
            head.stdout.close()


def counter_rows(count: int, increments: int = 3, seed: int = 3) -> list[dict[str, Any]]:
    """Rows in example_session_state_mgmt's shape, each with its own numbers."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        start = rng.randint(0, 50)
        adds = [rng.randint(1, 9) for _ in range(increments)]
        prompt = " then ".join(f"add {n}" for n in adds) + " then get the count"
        rows.append(
            {
                "responses_create_params": {
                    "input": [{"role": "user", "content": prompt}],
                    "tools": TOOLS,
                },
                "initial_count": start,
                "expected_count": start + sum(adds),
                "row": i,  # distinct rows get distinct task indices
            }
        )
    return rows


@dataclass
class Run:
    """What one rollout collection run reported."""

    finished: int
    seconds: float  # the collection's own run, its process start-up not counted
    cpu: float  # the collection's CPU seconds in that time
    rewards: dict[str, float | None]
    failures: list[dict[str, Any]]

    @property
    def right(self) -> int:
        return sum(1 for reward in self.rewards.values() if reward == 1.0)


@dataclass
class NemoStack:
    """The four servers (and the backend), under gym-proxy (`workers` per role) or, with
    `workers=None`, each as NeMo Gym runs it itself (one uvicorn process); with
    `uvicorn_workers`, each under `uvicorn --workers N` on one port (sessions split:
    the design gym-proxy replaces, for the bench)."""

    directory: Path
    workers: dict[str, int] | None = None
    uvicorn_workers: bool = False
    access_log: bool = True  # gym-proxy's and its workers' (the tier reads the workers')
    # `--preload`, as docs/nemo_gym.md recommends: NeMo Gym's imports once per server, not
    # once per worker (the launcher's tests and tests/test_nemo_gym_counter.py run without).
    preload: bool = True
    gym_proxy_args: dict[str, list[str]] = field(default_factory=dict)  # role -> extra flags
    expose_mcp: bool = False
    specs: list[ServerSpec] = field(default_factory=lambda: SPECS)  # SPECS or stack_specs()
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    collections: list[Rollouts] = field(default_factory=list)  # ended by stop() if running

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # Socket paths must fit sockaddr_un: the runtime directories live in a short one.
        self.runtime = tempfile.mkdtemp(prefix="ngs-", dir="/tmp")
        for role in ("head", "backend", *(spec.role for spec in self.specs)):
            self.ports.setdefault(role, free_port())
        (self.directory / "secret").write_text(TEST_SECRET)
        (self.directory / "control").write_text(CONTROL_TOKEN)
        self.config_path = self.directory / "config.yaml"
        self.config_path.write_text(json.dumps(self.global_config()))  # JSON is YAML

    @property
    def agent(self) -> str:
        """The agent the rollout collection drives."""
        return next(spec.instance for spec in self.specs if spec.role == "agent")

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def global_config(self) -> dict[str, Any]:
        """The global config NeMo Gym's launcher would pass every server."""
        config: dict[str, Any] = {
            "head_server": {"host": "127.0.0.1", "port": self.ports["head"]},
            "dry_run": False,
            "policy_base_url": f"{self.url('backend')}/v1",
            "policy_api_key": "unused",
            "policy_model_name": "scripted-policy",
            "ray_head_node_address": SharedRay.get().address,
        }
        for spec in self.specs:
            block = {"entrypoint": "app.py", "host": "127.0.0.1", "port": self.ports[spec.role]}
            block.update(spec.block)
            if spec.role == "resources" and self.expose_mcp:
                block["expose_tools_over_mcp"] = True
            name = spec.directory.name
            config[spec.instance] = {spec.server_type: {name: block}}
        return config

    def environment(self, spec: ServerSpec) -> dict[str, str]:
        return {
            **os.environ,
            "NEMO_GYM_CONFIG_DICT": self.config_path.read_text(),
            "NEMO_GYM_CONFIG_PATH": spec.instance,
            # What the launcher's children inherit from its own ray.init().
            "RAY_AUTH_MODE": SharedRay.get().auth_mode or "disabled",
            "BENCH_NEMO_GYM_APP": spec.app,  # for bench/nemo_gym_uvicorn.py
        }

    def start(
        self,
        workers: dict[str, int] | None | Literal["same"] = "same",
        roles: tuple[str, ...] | None = None,
    ) -> NemoStack:
        """Start the backend (once) and the servers (`roles`, default all)."""
        if workers != "same":
            self.workers = workers
        if "backend" not in self.procs or self.procs["backend"].poll() is not None:
            self._spawn(
                "backend",
                [sys.executable, "-m", "tests.nemo_gym.scripted_model", str(self.ports["backend"])],
                REPO,
                dict(os.environ),
            )
        for spec in self.specs:
            if roles is None or spec.role in roles:
                self._spawn(spec.role, self.command(spec), spec.directory, self.environment(spec))
        return self

    def command(self, spec: ServerSpec) -> list[str]:
        if self.workers is None:
            return [sys.executable, "app.py"]  # NeMo Gym's own way: uvicorn, one process
        if self.uvicorn_workers:
            return [
                sys.executable, "-m", "uvicorn", "bench.nemo_gym_uvicorn:create_app", "--factory",
                "--workers", str(self.workers[spec.role]), "--host", "127.0.0.1",
                "--port", str(self.ports[spec.role]), "--http", "httptools", "--no-access-log",
                "--log-level", "warning", "--app-dir", str(REPO),
            ]  # fmt: skip
        return [
            sys.executable, "-m", "gym_proxy", spec.app,
            "--workers", str(self.workers[spec.role]),
            "--secret-file", str(self.directory / "secret"),
            "--control-token-file", str(self.directory / "control"),
            "--runtime-dir", self.runtime,
            # A second test process shares the 2 cores: a NeMo Gym worker's imports then
            # take several times their usual seconds.
            "--boot-timeout", "180",
            "--log-level", "warning", *(["--access-log"] if self.access_log else []),
            *(["--preload"] if self.preload else []),
            *self.gym_proxy_args.get(spec.role, []),
        ]  # fmt: skip

    def _spawn(self, role: str, command: list[str], cwd: Path, env: dict[str, str]) -> None:
        log = open(self.directory / f"{role}.log", "ab")  # noqa: SIM115
        env = {**env, "PYTHONPATH": str(REPO)}
        self.procs[role] = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,  # its own process group
        )  # fmt: skip
        log.close()

    async def wait_serving(self, http: aiohttp.ClientSession, within: float = 200) -> None:
        """Until every server's NeMo Gym liveness route answers 200 (under gym-proxy: all
        of its workers have registered) and the backend answers."""

        async def serving() -> bool:
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{role} exited:\n{self.log(role)[-3000:]}")
            for role in self.procs:
                path = "/control/held" if role == "backend" else "/health"
                try:
                    async with http.get(f"{self.url(role)}{path}") as resp:
                        if resp.status != 200:
                            return False
                except aiohttp.ClientConnectionError:
                    return False
            return True

        await wait_until(serving, within, "every server of the NeMo Gym stack to serve")

    def log(self, role: str) -> str:
        path = self.directory / f"{role}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, roles: tuple[str, ...] | None = None) -> None:
        """SIGKILL the process groups of these servers (default: every server): a crash."""
        for role in roles or tuple(spec.role for spec in self.specs):
            proc = self.procs.get(role)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def stop(self) -> None:
        """Stop everything, gym-proxy's way (SIGTERM, then the group); a rollout
        collection still running (a failed test's) is killed first."""
        for collection in self.collections:
            collection.kill()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(self.runtime, ignore_errors=True)

    # ---- the rollout collection --------------------------------------------------
    def start_rollouts(self, rows: list[dict[str, Any]], concurrency: int) -> Rollouts:
        """NeMo Gym's rollout collection over `rows`, in a process of its own."""
        name = f"rollouts-{len(list(self.directory.glob('rollouts-*.in.jsonl')))}"
        source = self.directory / f"{name}.in.jsonl"
        source.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
        out = self.directory / f"{name}.out.jsonl"
        log = open(self.directory / f"{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.nemo_gym.drive", str(self.config_path), str(source),
             str(out), self.agent, str(concurrency)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True,
        )  # fmt: skip
        log.close()
        self.collections.append(Rollouts(proc, out, self.directory / f"{name}.log"))
        return self.collections[-1]

    # ---- what the workers saw -----------------------------------------------------
    def sessions_by_worker(self, role: str) -> dict[str, set[int]]:
        """Each app session's workers, from the workers' own access log lines
        (`worker <slot> <path> <status> session=<id>`; gym-proxy `--access-log`)."""
        seen: dict[str, set[int]] = {}
        for match in WORKER_ACCESS.finditer(self.log(role)):
            slot, _, _, session = match.groups()
            if session != "None":
                seen.setdefault(session, set()).add(int(slot))
        return seen


@dataclass
class Rollouts:
    """A rollout collection run in its own process."""

    proc: subprocess.Popen[bytes]
    out: Path
    log_path: Path

    def result(self, within: float = 300) -> Run:
        try:
            stdout, _ = self.proc.communicate(timeout=within)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the rollout collection did not finish:\n{self.log()}") from None
        if self.proc.returncode != 0:
            raise AssertionError(f"the rollout collection failed:\n{self.log()}")
        summary = orjson.loads(stdout.splitlines()[-1])
        failures_path = self.out.with_name(self.out.stem + "_failures.jsonl")
        failures = (
            [orjson.loads(line) for line in failures_path.read_bytes().splitlines() if line]
            if failures_path.exists()
            else []
        )
        return Run(
            summary["finished"], summary["seconds"], summary["cpu"], summary["rewards"], failures
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class CounterClient:
    """One rollout's calls to the counter the way NeMo Gym's agents make them: each call
    carries the cookies of the last response (`server_client.post(..., cookies=...)`),
    never a cookie jar."""

    def __init__(self, http: aiohttp.ClientSession, url: str, task: int) -> None:
        self.http = http
        self.url = url
        self.task = task
        self.cookies: dict[str, str] = {}
        self._mcp_token: str | None = None

    @property
    def mcp_token(self) -> str:
        """The session token of the MCP endpoint its seed's reply named."""
        assert self._mcp_token is not None, "the seed's reply named no MCP endpoint"
        return self._mcp_token

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.post(
            f"{self.url}{path}", data=orjson.dumps(body), cookies=self.cookies or None,
            headers={"Content-Type": "application/json"},
        ) as resp:  # fmt: skip
            assert resp.status == 200, (path, resp.status, await resp.text())
            self.cookies = {name: morsel.value for name, morsel in resp.cookies.items()}
            return await resp.json()

    async def seed(self, initial: int) -> dict[str, Any]:
        """As simple_agent seeds: the /run body, NeMo Gym 0.7.0's indices included."""
        body = {"initial_count": initial, "_ng_task_index": self.task, "_ng_rollout_index": 0}
        reply = await self.post("/seed_session", body)
        mcp = reply.get("mcp")
        if mcp is not None:
            self._mcp_token = mcp["headers"]["X-NeMo-Gym-Session-Token"]
        return reply

    async def count(self) -> int:
        return int((await self.post("/get_counter_value", {}))["count"])

    async def verify(self, expected: int) -> float:
        """The counter's own /verify, with the request and response fields NeMo Gym's
        verify request requires (the counter reads only `expected_count`)."""
        response = {
            "id": "resp", "created_at": 0, "model": "m", "object": "response", "output": [],
            "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
        }  # fmt: skip
        body = {
            "responses_create_params": {"input": "verify"},
            "response": response,
            "expected_count": expected,
        }
        return float((await self.post("/verify", body))["reward"])
